"""Probability (soft) targets of the parallel cross-entropy in real multi-process runs (Gloo, CPU): uneven
shards at 2 and 3 ranks, fewer classes than ranks, both target layouts."""
from tests.distributed.harness import case_tests

test_probability_targets = case_tests("tests.distributed.cases_probability_targets", world_size=(2, 3))
