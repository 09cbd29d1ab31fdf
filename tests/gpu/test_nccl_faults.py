"""A dead or stalled peer on NCCL: the watchdog aborts the communicator within
the timeout and the survivor gets an error naming the group and the
collective (raise policy) or ends with that message (default policy), instead
of spinning forever. Needs two GPUs: NCCL refuses two ranks on one device."""
import json
import os

import pytest
import torch

from tests.distributed.harness import REPO, run_script

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
SCRIPT = os.path.join(REPO, "tests", "distributed", "scripts", "peer_failure.py")
TIMEOUT = 8.0


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_nccl_peer_failure_raises_within_the_timeout(mode):
    results = run_script(SCRIPT, 2, [mode, TIMEOUT, "cuda"], env={"SHARDTORCH_ON_COMM_FAILURE": "raise"},
                         timeout=180)
    lines = [json.loads(line) for line in results[0][1].splitlines() if line.startswith("{")]
    assert lines, results[0][1][-3000:]
    survivor = lines[0]
    assert survivor["error"] is not None, "the surviving rank's op did not fail"
    assert "group 'tp'" in survivor["error"] and "nccl" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < TIMEOUT + 10, survivor
    print(f"nccl peer {mode}: error after {survivor['seconds']:.2f} s (timeout {TIMEOUT} s)")


def test_nccl_peer_stall_terminates_the_survivor_by_default():
    results = run_script(SCRIPT, 2, ["stall", TIMEOUT, "cuda"], timeout=180)
    code, output = results[0]
    assert code == 1, output[-3000:]
    assert "has not finished" in output and "group 'tp'" in output, output[-3000:]
    assert "terminating this process" in output


DEFERRED_SCRIPT = os.path.join(REPO, "tests", "distributed", "scripts", "deferred_check_peers.py")


def _reports(results):
    reports = []
    for code, output in results:
        lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        assert code == 0 and lines, output[-3000:]
        reports.append(lines[0])
    return reports


def test_a_bad_target_on_one_rank_raises_on_both_at_the_same_launch():
    """Found on the device: each rank raises at its 8th launch after the loss's gather (the 2nd
    launch: the warm-up reduce, then the gather), the same one, and the group works again."""
    first, second = _reports(run_script(DEFERRED_SCRIPT, 2, ["target", TIMEOUT], timeout=180))
    assert first["raised_at"] == second["raised_at"] == 2 + 8, (first, second)
    assert "group rank 1 failed a check" in first["error"], first
    assert "target values must be in [0, num_classes=10)" in second["error"] and "got 99" in second["error"], second
    assert first["after"] == second["after"] == "ok", (first, second)


def test_a_misbuilt_shard_on_one_rank_raises_on_both_without_waiting_for_the_timeout():
    """Found on rank 1's host: it raises at once and leaves; rank 0 raises at its 8th launch after
    the gather at the latest (sooner where its watchdog read the verdict first) and aborts its
    communicator, so the collectives it launched meanwhile return."""
    first, second = _reports(run_script(DEFERRED_SCRIPT, 2, ["shard", TIMEOUT], timeout=180))
    assert second["raised_at"] == 2 and "must be rank 1's shard of num_classes=10" in second["error"], second
    assert 2 < first["raised_at"] <= 2 + 8 and "group rank 1 failed a check" in first["error"], first
    assert "is aborted" in first["error"], first
    for report in (first, second):
        assert report["seconds"] < TIMEOUT, report  # a hang would last the timeout, or forever
    assert "aborted" in first["after"] and "left the group's collectives" in second["after"], (first, second)


def test_a_backward_after_a_rank_left_raises_without_waiting_for_the_timeout():
    """The GPU twin of tests/unit/test_deferred_checks_in_ops.py's backward case: rank 0's backward
    launches an all-reduce that rank 1 (which raised alone in the loss) never joins; its watchdog
    reads the verdict from the check's copy and aborts, so the backward or loss.item() after it
    raises the verdict well within the group's timeout."""
    first, second = _reports(run_script(DEFERRED_SCRIPT, 2, ["backward", TIMEOUT], timeout=180))
    assert "must be rank 1's shard of num_classes=10" in second["error"], second
    assert first["error"] is not None and "group rank 1 failed a check" in first["error"], first
    assert "is aborted" in first["error"], first
    for report in (first, second):
        assert report["seconds"] < TIMEOUT, report  # a hang would last the timeout, or forever
