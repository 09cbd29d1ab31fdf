"""Parallel cross-entropy in real multi-process runs (Gloo, CPU)."""
from tests.distributed.harness import case_tests

test_parallel_cross_entropy = case_tests("tests.distributed.cases_cross_entropy", world_size=(2, 4))
