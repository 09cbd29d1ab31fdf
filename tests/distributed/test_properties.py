"""Property-based checks (hypothesis, derandomized, bounded) of ParallelLinear,
ParallelCrossEntropyLoss and the fused linear + cross-entropy against unsharded
torch in float64, inside one launch per world size."""
import pytest

from tests.distributed import cases_properties
from tests.distributed.harness import case_names

MODULE = "tests.distributed.cases_properties"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", case_names(cases_properties))
def test_property(launches, world_size, case):
    results = launches.get(MODULE, world_size)
    assert results[case] is None, results[case]
