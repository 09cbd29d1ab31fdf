"""The fork servers (tests/fork_server.py) start a rank as exec would have: its argv, path, directory,
environment, output and exit code (a signal's too), a hash seed and a random state of its own per
rank; and a rank whose environment differs from the servers' in more than what is read at run time
starts by exec."""
import json
import os
import signal

import pytest

from tests import fork_server
from tests.distributed.harness import REPO, run_script

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
