"""Parallel cross-entropy in real multi-process runs (Gloo, CPU)."""
import pytest

from tests.distributed import cases_cross_entropy
from tests.distributed.harness import case_names

MODULE = "tests.distributed.cases_cross_entropy"
CASES = case_names(cases_cross_entropy)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_parallel_cross_entropy(launches, world_size, case):
    results = launches.get(MODULE, world_size)
    assert results[case] is None, results[case]

