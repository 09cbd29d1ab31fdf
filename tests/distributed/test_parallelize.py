"""ts.nn.parallelize of whole models in real multi-process runs (Gloo, CPU, float64).

One launch per world size, and one at world 4 in groups of 2; training the 2 data-parallel x 2
tensor-parallel layout under DDP and FSDP2 is tests/distributed/test_parallelize_data_parallel.py."""
from tests.distributed.harness import case_tests

MODULE = "tests.distributed.cases_parallelize"

# 3 ranks split most head counts unevenly (tests/distributed/parallelize_models.py).
test_parallelize = case_tests(MODULE, world_size=(2, 3, 4))
# Every model case again at world 4 in tensor-parallel groups of 2 (two groups side by side, each
# exact on its own: shardtorch's groups, not the whole world, decide the split).
test_parallelize_in_2d_layout = case_tests(MODULE, world_size=4, group_size=2)
