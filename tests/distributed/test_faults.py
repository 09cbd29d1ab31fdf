"""Failures are loud and early: a dead or stalled peer gives an error naming
the group and the collective within the timeout; SHARDTORCH_DEBUG names the rank
whose collective disagrees."""
import json
import os
import subprocess
import sys

import pytest

from tests.distributed.harness import REPO, free_port, run_script

SCRIPTS = os.path.join(REPO, "tests", "distributed", "scripts")


def _json_lines(output):
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("transport", ["shared memory", "gloo"])
@pytest.mark.parametrize("mode", ["die", "stall"])
def test_peer_failure_becomes_an_error_within_the_timeout(mode, transport, tmp_path):
    timeout = 6.0
    # The stalled rank stays stalled until the survivor has reported (not a fixed 4 timeouts).
    results = run_script(os.path.join(SCRIPTS, "peer_failure.py"), 2, [mode, timeout], timeout=120,
                         env={"PEER_FAILURE_DONE_FILE": str(tmp_path / "survivor-done"),
                              "SHARDTORCH_SHARED_MEMORY": "1" if transport == "shared memory" else "0"})
    (survivor,) = _json_lines(results[0][1]) or [None]
    assert survivor is not None, results[0][1][-3000:]
    assert survivor["error"] is not None, "the surviving rank's op did not fail"
    assert "group 'tp'" in survivor["error"] and "all_reduce" in survivor["error"], survivor["error"]
    # The C++ core knows the group's timeout too: NCCL's watchdog enforces it.
    assert survivor["group_timeout"] == timeout, survivor
    # Detected within the timeout (plus slack for a loaded machine), not a hang.
    assert survivor["seconds"] < timeout + 10, survivor
    if mode == "die" and transport == "shared memory":  # the segment sees the pid gone: no timeout
        assert "rank 1 of the group" in survivor["error"] and "exited" in survivor["error"], survivor
        assert survivor["seconds"] < timeout, survivor
    print(f"peer {mode} ({transport}): error after {survivor['seconds']:.2f} s (timeout {timeout} s)")


def test_debug_mode_names_the_rank_that_disagrees():
    results = run_script(os.path.join(SCRIPTS, "debug_mismatch.py"), 2, env={"SHARDTORCH_DEBUG": "1"})
    lines = [line for _, out in results for line in _json_lines(out)]
    assert len(lines) == 2, [out[-2000:] for _, out in results]
    for line in lines:
        assert line["sum_ok"] == 12.0
        assert line["error"] and "SHARDTORCH_DEBUG" in line["error"], line
        assert "global rank 1 calls all_reduce of Float [2, 4]" in line["error"], line["error"]
        assert "global rank 1 calls broadcast of Float [4]" in line["layer_error"], line["layer_error"]
        assert line["same_targets_loss"] > 0
        for name, error in line["target_errors"].items():
            assert error is not None, f"{name}: differing targets passed"
            assert "must hold the same target" in error and "global rank 1's differs" in error, error
            assert "first at element 3: 7 vs 4" in error, error


def test_a_peer_that_exited_unreaped_is_told_from_a_live_one():
    # Rank 1 is rank 0's own child and rank 0 never reaps it: it stays a zombie, which kill(pid, 0)
    # takes for alive. The survivor must say that rank 1 exited, not time out waiting for it.
    timeout = 30.0
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "zombie_peer.py"), str(free_port()),
                           str(timeout)], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120)
    (survivor,) = _json_lines(done.stdout) or [None]
    assert survivor is not None, (done.stdout + done.stderr)[-3000:]
    error = survivor["error"]
    assert error is not None, "the surviving rank's all-reduce did not fail"
    assert f"rank 1 of the group (pid {survivor['child']}) exited" in error, error
    assert "group 'tp'" in error and "all_reduce" in error and "timed out" not in error, error
