"""ts.nn.parallelize of whole models in real multi-process runs (Gloo, CPU, float64)."""
from tests.distributed.harness import case_tests

MODULE = "tests.distributed.cases_parallelize"

# 3 ranks split most head counts unevenly (tests/distributed/parallelize_models.py).
test_parallelize = case_tests(MODULE, world_size=(2, 3, 4))
# World 4 as 2 data-parallel x 2 tensor-parallel groups.
test_parallelize_in_2d_layout = case_tests(MODULE, world_size=4, group_size=2)
