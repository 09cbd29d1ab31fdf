"""FSDP2 (fully_shard) x tensor parallel in real multi-process runs: world 4 =
2 x 2 for training and checkpoints (in the session's shared 4 x 2 launch), then
two launches of 2 ranks (1 x 2 and 2 x 1, DDP x TP) that resume from its
checkpoint.

Run with -s to see the largest parameter error of each run."""
import os

import pytest

from tests.distributed.cases_fully_shard import HANDOFF_DIR, REPORT_FILE
from tests.distributed.harness import case_names, case_tests, reads_launch, scratch_dir

MODULE = "tests.distributed.cases_fully_shard"
RESUME = "tests.distributed.cases_fully_shard_resume"
# The resume launches read the 4-rank launch's checkpoint: their own key (this
# env), so that they never join a launch that could run before it.
RESUME_ENV = {"SHARDTORCH_FSDP_HANDOFF": os.path.join(scratch_dir(), HANDOFF_DIR)}

test_fully_shard = case_tests(MODULE, world_size=4, group_size=2)


@pytest.mark.parametrize("group_size", [2, 1])
@pytest.mark.parametrize("case", case_names(RESUME))
@reads_launch(MODULE, 4, 2, cases=["case_hand_off_to_two_ranks"])
def test_resume_under_ddp_at_two_ranks(launches, case, group_size):
    # The 4-rank launch writes the checkpoint first.
    saved = launches.get(MODULE, 4, 2, cases=["case_hand_off_to_two_ranks"])
    assert saved["case_hand_off_to_two_ranks"] is None, saved["case_hand_off_to_two_ranks"]
    results = launches.get(RESUME, 2, group_size, env=RESUME_ENV)
    assert results[case] is None, results[case]


@reads_launch(MODULE, 4, 2)
def test_largest_parameter_error_per_run(launches):
    launches.get(MODULE, 4, 2)
    with open(os.path.join(scratch_dir(), REPORT_FILE)) as f:
        lines = [line.rstrip("\n").split("\t") for line in f]
    print("\nlargest relative parameter error against unsharded training:")
    for what, error in lines:
        print(f"  {what:75s} {error}")
    runs = {what for what, _ in lines}
    for layout in ("2d", "hybrid"):
        for optimizer in ("sgd", "adam"):
            assert f"{layout} {optimizer}" in runs
