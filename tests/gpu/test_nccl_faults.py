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
