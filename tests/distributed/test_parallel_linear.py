"""ParallelLinear and the mappings in real multi-process runs (Gloo, CPU)."""
import pytest

from tests.distributed import cases_linear
from tests.distributed.harness import case_names

MODULE = "tests.distributed.cases_linear"
CASES = case_names(cases_linear)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_parallel_linear(launches, world_size, case):
    results = launches.get(MODULE, world_size)
    assert results[case] is None, results[case]


@pytest.mark.parametrize("case", ["case_layer_matches_nn_linear_float64",
                                  "case_column_then_row_mlp_trains_like_unsharded",
                                  "case_mappings_forward_and_adjoint"])
def test_parallel_linear_in_2d_layout(launches, case):
    """World 4 as 2 data-parallel x 2 tensor-parallel groups."""
    results = launches.get(MODULE, 4, 2)
    assert results[case] is None, results[case]
