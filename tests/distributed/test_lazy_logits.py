"""parallelize's default lazy logits at 2 ranks, in the 2-rank launch of the tests beside it."""
from tests.distributed.harness import case_tests

test_lazy_logits = case_tests("tests.distributed.cases_lazy_logits", world_size=2)
