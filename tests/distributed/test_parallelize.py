"""ts.nn.parallelize of whole models in real multi-process runs (Gloo, CPU, float64).

One launch per world size; the 2 data-parallel x 2 tensor-parallel layout (DDP, FSDP2) is
tests/distributed/test_parallelize_data_parallel.py (the models there split over groups of 2, as at world 2)."""
from tests.distributed.harness import case_tests

MODULE = "tests.distributed.cases_parallelize"

# 3 ranks split most head counts unevenly (tests/distributed/parallelize_models.py).
test_parallelize = case_tests(MODULE, world_size=(2, 3, 4))
