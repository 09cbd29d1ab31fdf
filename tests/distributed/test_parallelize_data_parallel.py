"""ts.nn.parallelize under DDP and FSDP2 at 4 ranks as 2 data-parallel x 2 tensor-parallel groups (Gloo, CPU)."""
from tests.distributed.harness import case_tests

test_parallelize_data_parallel = case_tests("tests.distributed.cases_parallelize_data_parallel", world_size=4,
                                            group_size=2)
