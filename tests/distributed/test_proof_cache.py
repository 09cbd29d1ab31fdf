"""Proofs kept and reused, at 2 and 3 ranks, in the launches of test_parallelize.py."""
from tests.distributed.harness import case_tests

test_proof_cache = case_tests("tests.distributed.cases_proof_cache", world_size=(2, 3))
