"""The fork servers (tests/fork_server.py, configuring shardtorch/utils/fork_server.py) start a rank as exec would have: its argv, path, directory,
environment, output and exit code (a signal's too), a hash seed and a random state of its own per
rank; and a rank whose environment differs from the servers' in more than what is read at run time
starts by exec."""
import json
import os
import signal
import sys

import pytest

from tests import fork_server
from tests.distributed.harness import REPO, run_script
from tests.launcher import run_ranks, start_ranks, wait_ranks

SCRIPT = os.path.join(REPO, "tests", "distributed", "scripts", "report_start.py")


def _reports(results):
    reports = []
    for code, output in results:
        lines = output.splitlines()
        assert "to stderr" in lines, output
        reports.append((code, json.loads(lines[0])))
    return reports


@pytest.mark.skipif(not fork_server._enabled(), reason="fork servers turned off (SHARDTORCH_TEST_FORK=0)")
def test_a_forked_rank_starts_as_exec_would_have():
    forked = _reports(run_script(SCRIPT, 2, ["7"]))
    assert [report["preloaded"] for _, report in forked] == [True, True], "the ranks were not forked"
    for rank, (code, report) in enumerate(forked):
        assert code == 7
        assert report["argv"] == [SCRIPT, "7"] and report["name"] == "__main__"
        assert report["path0"] == os.path.dirname(SCRIPT) and report["cwd"] == REPO
        assert report["rank"] == str(rank)
    # Fresh interpreters differ in both; so must ranks forked from servers.
    assert forked[0][1]["hash"] != forked[1][1]["hash"]
    assert forked[0][1]["random"] != forked[1][1]["random"]
    again = _reports(run_script(SCRIPT, 2, ["0"]))
    assert [code for code, _ in again] == [0, 0] and again[0][1]["random"] != forked[0][1]["random"]


@pytest.mark.skipif(not fork_server._enabled(), reason="fork servers turned off (SHARDTORCH_TEST_FORK=0)")
def test_a_killed_forked_rank_reports_the_signal():
    (code, report), = _reports(run_script(SCRIPT, 1, ["kill"]))
    assert report["preloaded"] and code == -signal.SIGKILL


def test_a_variable_read_at_start_up_means_exec(monkeypatch):
    (code, report), = _reports(run_script(SCRIPT, 1, ["3"], env={"REPORT_START_EXTRA": "x"}))
    assert not report["preloaded"] and report["extra"] == "x" and code == 3
    # What the forked ranks above are held to, from a real exec:
    assert report["argv"] == [SCRIPT, "3"] and report["name"] == "__main__"
    assert report["path0"] == os.path.dirname(SCRIPT) and report["cwd"] == REPO
    monkeypatch.setenv("SHARDTORCH_TEST_FORK", "0")
    (code, report), = _reports(run_script(SCRIPT, 1, ["5"]))
    assert not report["preloaded"] and code == 5 and report["argv"] == [SCRIPT, "5"]


@pytest.mark.skipif(not fork_server._enabled(), reason="fork servers turned off (SHARDTORCH_TEST_FORK=0)")
def test_a_module_run_with_dash_m_starts_as_exec_would_have():
    module = "tests.distributed.scripts.report_start"
    results = run_ranks([sys.executable, "-m", module, "4"], 2, 120, spawn=fork_server.spawn)
    assert "RuntimeWarning" not in results[0][1], results[0][1]
    for code, report in _reports(results):
        assert report["preloaded"] and code == 4
        assert report["argv"] == [SCRIPT, "4"] and report["name"] == "__main__" and report["path0"] == REPO


@pytest.mark.skipif(not fork_server._enabled(), reason="fork servers turned off (SHARDTORCH_TEST_FORK=0)")
def test_a_rank_past_its_timeout_is_killed():
    procs = start_ranks([sys.executable, SCRIPT, "sleep"], 2, spawn=fork_server.spawn)
    assert all(isinstance(proc, fork_server.ForkedRank) for proc in procs)
    with pytest.raises(RuntimeError, match="did not finish within 2"):
        wait_ranks(procs, 2, "sleepers")
    assert [proc.returncode for proc in procs] == [-signal.SIGKILL] * 2
    for proc in procs:  # reaped by its supervisor: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(proc.pid, 0)
