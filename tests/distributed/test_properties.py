"""Property-based checks (hypothesis, derandomized, bounded) of ParallelLinear,
ParallelCrossEntropyLoss and the fused linear + cross-entropy against unsharded
torch in float64, inside one launch per world size."""
from tests.distributed.harness import case_tests

test_property = case_tests("tests.distributed.cases_properties", world_size=(2, 4))
