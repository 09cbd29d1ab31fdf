"""shardtorch's process groups over their lifetime (init, re-init, destroy) on
2 real ranks."""
from tests.distributed.harness import case_tests

test_process_group = case_tests("tests.distributed.cases_process_group", world_size=2, init=False)

# DeviceMesh interop needs a 2 x 2 world.
test_device_mesh = case_tests("tests.distributed.cases_device_mesh", world_size=4, init=False)
