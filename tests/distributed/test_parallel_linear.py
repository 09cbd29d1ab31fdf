"""ParallelLinear and the mappings in real multi-process runs (Gloo, CPU)."""
from tests.distributed.harness import case_tests

MODULE = "tests.distributed.cases_linear"

test_parallel_linear = case_tests(MODULE, world_size=(2, 4))
# World 4 as 2 data-parallel x 2 tensor-parallel groups.
test_parallel_linear_in_2d_layout = case_tests(MODULE, world_size=4, group_size=2, cases=[
    "case_layer_matches_nn_linear_float64", "case_column_then_row_mlp_trains_like_unsharded",
    "case_mappings_forward_and_adjoint"])
