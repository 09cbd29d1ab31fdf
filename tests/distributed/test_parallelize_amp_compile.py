"""ts.nn.parallelize under torch.autocast (bfloat16) and torch.compile, on 3 ranks (uneven heads; Gloo, CPU)."""
from tests.distributed.harness import case_tests

test_parallelize_amp_compile = case_tests("tests.distributed.cases_parallelize_amp_compile", world_size=3)
