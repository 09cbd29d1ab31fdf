"""ParallelEmbedding and the layer conversions in real multi-process runs (Gloo, CPU)."""
import pytest

from tests.distributed import cases_embedding
from tests.distributed.harness import case_names

MODULE = "tests.distributed.cases_embedding"
CASES = case_names(cases_embedding)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_parallel_embedding(launches, world_size, case):
    results = launches.get(MODULE, world_size)
    assert results[case] is None, results[case]
