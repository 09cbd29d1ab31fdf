"""Checkpoints across tensor-parallel sizes: save at one size in one launch,
load in later launches at others (1 -> 2 -> 4 -> 2, 4 -> 1, and the 2-D layout
of 2 data-parallel x 2 tensor-parallel groups). The phases run once per session, in this
order, beside test_optimizer_state.py's where sizes and order allow (checkpoint_phases.py)."""
import pytest

from tests.distributed import checkpoint_phases
from tests.distributed.harness import check_phases

MODULE = "tests.distributed.cases_checkpoint"
ANY_SIZE = ["case_collect_equals_unsharded_reference", "case_relocate_round_trip_and_from_plain",
            "case_wrong_checkpoint_names_the_key_on_every_rank"]

# (world, tensor-parallel size, cases), in the order they must run.
PHASES = {
    "size1": (1, 1, ANY_SIZE + ["case_save_size1"]),
    # Saves a good checkpoint, then dies (os._exit(17)) in the middle of a second save.
    "killed_save": (1, 1, ["case_save_then_die_midway"]),
    "size2": (2, 2, ANY_SIZE + ["case_load_size1", "case_load_plain", "case_save_size2",
                                "case_ddp_wrapped_and_prefix_matching",
                                "case_sharded_failed_save_keeps_previous",
                                "case_sharded_corrupt_checkpoints_are_named", "case_save_dcp"]),
    "size4": (4, 4, ANY_SIZE + ["case_load_size2", "case_load_size1", "case_save_size4", "case_load_dcp_2",
                                "case_dcp_with_empty_shards"]),
    "2d": (4, 2, ANY_SIZE + ["case_load_size4", "case_load_size1", "case_save_2d", "case_load_2d",
                             "case_ddp_wrapped_and_prefix_matching",
                             "case_sharded_failed_save_keeps_previous", "case_save_dcp"]),
    "size2_from4": (2, 2, ["case_load_size4", "case_load_2d", "case_load_after_killed_save"]),
    "size1_from4": (1, 1, ["case_load_size4", "case_load_size2", "case_load_dcp_4x2",
                           "case_dcp_to_torch_save_gives_the_unsharded_state_dict"]),
}


def test_every_case_runs_in_a_phase():
    """A case listed in no phase would never run: fail instead."""
    check_phases(MODULE, PHASES)


@pytest.mark.parametrize("phase", list(PHASES))
def test_checkpoint_phase(phase):
    checkpoint_phases.check(MODULE, phase)

