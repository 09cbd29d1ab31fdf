"""The package's one collective layer (shardtorch/distributed/collectives.py) on real ranks: 2
ranks in one group, and 4 ranks in two tensor-parallel groups (src and dst are global ranks that
differ from group ranks there)."""
from tests.distributed.harness import case_tests

test_collectives = case_tests("tests.distributed.cases_collectives", world_size=2)
test_collectives_two_groups = case_tests("tests.distributed.cases_collectives", world_size=4, group_size=2)
