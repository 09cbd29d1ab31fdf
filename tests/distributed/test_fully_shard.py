"""FSDP2 (fully_shard) x tensor parallel in real multi-process runs: one
launch of world 4 = 2 x 2 for training and checkpoints, then two launches of
2 ranks (1 x 2 and 2 x 1, DDP x TP) that resume from its checkpoint.

Run with -s to see the largest parameter error of each run."""
import os
import shutil
import tempfile

import pytest

from tests.distributed.harness import case_names, case_tests

MODULE = "tests.distributed.cases_fully_shard"
RESUME = "tests.distributed.cases_fully_shard_resume"
_SCRATCH = os.path.join(tempfile.gettempdir(), f"shardtorch-fsdp-{os.getpid()}")
REPORT = _SCRATCH + ".txt"
HANDOFF = _SCRATCH + "-handoff"
ENV = {"SHARDTORCH_FSDP_REPORT": REPORT, "SHARDTORCH_FSDP_HANDOFF": HANDOFF}
for stale in (REPORT, HANDOFF):  # a previous process with the same id
    if os.path.isdir(stale):
        shutil.rmtree(stale)
    elif os.path.exists(stale):
        os.remove(stale)
os.makedirs(HANDOFF, exist_ok=True)

test_fully_shard = case_tests(MODULE, world_size=4, group_size=2, env=ENV)


@pytest.mark.parametrize("group_size", [2, 1])
@pytest.mark.parametrize("case", case_names(__import__(RESUME, fromlist=["_"])))
def test_resume_under_ddp_at_two_ranks(launches, case, group_size):
    saved = launches.get(MODULE, 4, 2, env=ENV)  # the 4-rank launch writes the checkpoint first
    assert saved["case_hand_off_to_two_ranks"] is None, saved["case_hand_off_to_two_ranks"]
    results = launches.get(RESUME, 2, group_size, env=ENV)
    assert results[case] is None, results[case]


def test_largest_parameter_error_per_run(launches):
    launches.get(MODULE, 4, 2, env=ENV)
    with open(REPORT) as f:
        lines = [line.rstrip("\n").split("\t") for line in f]
    print("\nlargest relative parameter error against unsharded training:")
    for what, error in lines:
        print(f"  {what:75s} {error}")
    runs = {what for what, _ in lines}
    for layout in ("2d", "hybrid"):
        for optimizer in ("sgd", "adam"):
            assert f"{layout} {optimizer}" in runs
