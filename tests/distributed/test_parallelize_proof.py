"""The proof parallelize runs before it returns, at 2 and 3 ranks, in the launches of test_parallelize.py."""
from tests.distributed.harness import case_tests

test_parallelize_proof = case_tests("tests.distributed.cases_parallelize_proof", world_size=(2, 3))
