"""ts.nn.parallelize across the transformers zoo at 2 and 3 ranks (3 splits most head counts unevenly),
in the same launches as test_parallelize.py."""
from tests.distributed.harness import case_tests

test_parallelize_zoo = case_tests("tests.distributed.cases_parallelize_zoo", world_size=(2, 3))
