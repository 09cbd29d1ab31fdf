"""The margin softmax and its class sampling on 2 and 4 real ranks, and with
data-parallel replicas (4 ranks, shard groups of 2)."""
from tests.distributed.harness import case_tests

test_margin = case_tests("tests.distributed.cases_margin", world_size=(2, 4))
test_margin_data_parallel = case_tests("tests.distributed.cases_margin_dp", world_size=4, group_size=2)
