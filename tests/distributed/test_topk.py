"""Logit-free top-k over sharded classes on 2 and 3 real ranks."""
from tests.distributed.harness import case_tests

test_topk = case_tests("tests.distributed.cases_topk", world_size=(2, 3))
