"""TorchShard's usage patterns (tests/compat/cases_torchshard.py) on real
ranks: world 2 as one group, world 4 as 2 data-parallel x 2 tensor-parallel."""
from tests.distributed.harness import case_tests

MODULE = "tests.compat.cases_torchshard"

test_torchshard_patterns = case_tests(MODULE, world_size=2)
test_torchshard_patterns_2x2 = case_tests(MODULE, world_size=4, group_size=2)
