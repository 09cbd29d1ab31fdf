"""Models no rank holds whole: ts.nn.from_pretrained, from_config, save_pretrained, and torch's
get_state_dict / set_state_dict with DCP, saved at 2 ranks and loaded at 4 and 3. The phases run
once per session beside test_checkpoint.py's (checkpoint_phases.py)."""
import pytest

from tests.distributed import checkpoint_phases
from tests.distributed.harness import check_phases

MODULE = "tests.distributed.cases_pretrained"
ANY_SIZE = ["case_loaded_models_equal_the_unsharded_model", "case_fresh_models_draw_the_unsharded_models_slices",
            "case_bfloat16_shards_are_the_checkpoint_slices"]
LATER = ["case_load_what_2_ranks_saved", "case_dcp_load_with_torch_set_state_dict"]

# (world, tensor-parallel size, cases), in the order they must run.
PHASES = {
    "save2": (2, 2, ["case_write_reference_checkpoints"] + ANY_SIZE + [
        "case_sequence_parallel_loaded_model_gradients_match_unsharded",
        "case_fresh_init_refuses_what_it_cannot_draw_by_slices", "case_fresh_init_that_reads_values_is_refused_and_loads_anyway", "case_missing_weights_are_initialised_alike_and_named",
        "case_bad_checkpoints_raise_on_every_rank_before_reading", "case_save_pretrained_writes_the_unsharded_checkpoint",
        "case_save_pretrained_writes_what_transformers_saves",
        "case_dcp_save_with_torch_get_state_dict"]),
    "load4": (4, 4, LATER + ["case_a_model_larger_than_the_memory_limit_loads_and_trains"]),
    "load3": (3, 3, LATER + ANY_SIZE + ["case_every_zoo_architecture_loads_and_draws_exactly",
                                        "case_torch_full_state_dict_is_the_unsharded_one"]),
}


def test_every_case_runs_in_a_phase():
    check_phases(MODULE, PHASES)


@pytest.mark.parametrize("phase", list(PHASES))
def test_pretrained_phase(phase):
    checkpoint_phases.check(MODULE, phase)
