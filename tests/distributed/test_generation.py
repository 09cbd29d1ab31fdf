"""Generation and whole logits of parallelized models (tests/distributed/cases_generation.py), at 2
ranks and at 3 (heads and vocabulary split unevenly), in the launches test_parallelize.py starts."""
from tests.distributed.harness import case_tests

test_generation = case_tests("tests.distributed.cases_generation", world_size=(2, 3))
