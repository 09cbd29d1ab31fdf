"""The collective watchdog that makes a stuck NCCL collective an error instead
of a hang, driven with Python callables in place of CUDA events and NCCL
(the NCCL wiring itself runs in tests/gpu). Times are measured, not assumed:
each test reads the clock when the fake collective starts and when the
watchdog reports."""
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.doubles import _C_testing

POLL = 0.01


class FakeCollective:
    """A collective whose start and end the test controls."""

    def __init__(self, started=True, done=False):
        self.started_flag = threading.Event()
        self.done_flag = threading.Event()
        self.started_at = None
        if started:
            self.start()
        if done:
            self.done_flag.set()

    def start(self):
        self.started_at = time.monotonic()
        self.started_flag.set()

    def started(self):
        return self.started_flag.is_set()

    def done(self):
        return self.done_flag.is_set()


class FakeBackend:
    def __init__(self):
        self.error = ""
        self.aborts = []

    def async_error(self):
        return self.error

    def abort(self):
        self.aborts.append(time.monotonic())


def _watchdog(backend, timeout, policy="raise", group="group 'tp' (rank 1 of 2, fake)", on_thread_start=None):
    return _C_testing._CollectiveWatchdog(group, timeout, backend.async_error, backend.abort, policy=policy,
                                  poll_interval=POLL, on_thread_start=on_thread_start)


def _wait_for(predicate, limit):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL / 2)
    return predicate()


def test_finished_collectives_leave_no_trace():
    backend = FakeBackend()
    with _watchdog(backend, timeout=0.5) as watchdog:
        work = [FakeCollective() for _ in range(5)]
        sequences = [watchdog.watch("all_reduce", w.started, w.done) for w in work]
        assert sequences == list(range(5))
        for w in work:
            w.done_flag.set()
        assert _wait_for(lambda: watchdog.pending == 0, 2.0), watchdog.pending
        time.sleep(0.7)  # past the timeout: finished work must not fail later
        assert not watchdog.failed
        watchdog.check()
    assert backend.aborts == []


def test_stalled_collective_fails_within_the_timeout_and_aborts_once():
    backend = FakeBackend()
    timeout = 0.4
    with _watchdog(backend, timeout) as watchdog:
        done = FakeCollective(done=True)
        stuck = FakeCollective()
        watchdog.watch("all_gather", done.started, done.done)
        watchdog.watch("reduce_scatter", stuck.started, stuck.done)
        assert _wait_for(lambda: watchdog.failed, timeout + 2.0)
        waited = backend.aborts[0] - stuck.started_at
        time.sleep(0.2)
        assert len(backend.aborts) == 1
        message = watchdog.failure
        with pytest.raises(RuntimeError) as raised:
            watchdog.check()
    assert timeout <= waited < timeout + 0.5, waited
    for part in ("reduce_scatter #1", "group 'tp' (rank 1 of 2, fake)", "timeout 0.4 s", "aborted"):
        assert part in message and part in str(raised.value), (part, message)


def test_timeout_counts_from_the_start_not_the_launch():
    """A collective queued behind long compute is not blamed for the wait."""
    backend = FakeBackend()
    timeout = 0.3
    with _watchdog(backend, timeout) as watchdog:
        queued = FakeCollective(started=False)
        launched_at = time.monotonic()
        watchdog.watch("broadcast", queued.started, queued.done)
        time.sleep(3 * timeout)
        assert not watchdog.failed, watchdog.failure
        queued.start()
        assert _wait_for(lambda: watchdog.failed, timeout + 2.0)
        waited = backend.aborts[0] - queued.started_at
    assert timeout <= waited < timeout + 0.5, waited
    assert backend.aborts[0] - launched_at >= 4 * timeout


def test_thread_setup_runs_first_on_the_watchdog_thread():
    """NCCL selects the communicator's device there (else polling its events
    would create a context on device 0)."""
    threads = []
    backend = FakeBackend()
    with _watchdog(backend, timeout=5.0, on_thread_start=lambda: threads.append(threading.get_ident())) as watchdog:
        seen = []
        work = FakeCollective(done=True)
        watchdog.watch("all_reduce", lambda: seen.append(threading.get_ident()) or True, work.done)
        assert _wait_for(lambda: watchdog.pending == 0, 2.0)
    assert len(threads) == 1 and threads[0] != threading.get_ident()
    assert seen and set(seen) == set(threads)


def test_async_error_after_all_work_finished_is_ignored():
    """A peer that exits cleanly after the last collective may leave an error
    behind; with nothing unfinished it concerns nobody."""
    backend = FakeBackend()
    backend.error = "remote process exited"
    with _watchdog(backend, timeout=5.0) as watchdog:
        work = FakeCollective(done=True)
        watchdog.watch("all_reduce", work.started, work.done)
        assert _wait_for(lambda: watchdog.pending == 0, 2.0)
        time.sleep(0.2)
        assert not watchdog.failed, watchdog.failure


def test_async_error_fails_at_once_naming_the_error_and_the_collective():
    backend = FakeBackend()
    with _watchdog(backend, timeout=60.0) as watchdog:
        stuck = FakeCollective()
        watchdog.watch("all_reduce", stuck.started, stuck.done)
        time.sleep(5 * POLL)
        assert not watchdog.failed
        backend.error = "remote process exited or there was a network error"
        raised_at = time.monotonic()
        assert _wait_for(lambda: watchdog.failed, 2.0)
        message = watchdog.failure
    assert backend.aborts and backend.aborts[0] - raised_at < 1.0
    assert "all_reduce #0" in message and "remote process exited" in message, message


def test_a_callback_that_raises_stops_watching_that_collective_only():
    backend = FakeBackend()
    with _watchdog(backend, timeout=0.3) as watchdog:
        def broken():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        watchdog.watch("all_reduce", lambda: True, broken)
        assert _wait_for(lambda: watchdog.pending == 0, 2.0)
        time.sleep(0.5)
        assert not watchdog.failed and backend.aborts == []
        stuck = FakeCollective()
        watchdog.watch("all_gather", stuck.started, stuck.done)
        assert _wait_for(lambda: watchdog.failed, 2.0)
        assert "all_gather #1" in watchdog.failure


def test_a_stopped_watchdog_no_longer_aborts_but_still_answers():
    """The communicator stops it before its NCCL state goes; handles that
    outlive the communicator may still ask it."""
    backend = FakeBackend()
    with _watchdog(backend, timeout=0.2) as watchdog:
        stuck = FakeCollective()
        watchdog.watch("all_reduce", stuck.started, stuck.done)
        watchdog.stop()
        watchdog.stop()  # idempotent
        time.sleep(0.5)
        assert not watchdog.failed and backend.aborts == []
        watchdog.check()


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_timeout_must_be_positive(bad):
    with pytest.raises(RuntimeError, match="timeout must be positive"):
        _watchdog(FakeBackend(), timeout=bad)


_TERMINATE = """
import sys, time
from shardtorch import _C_testing
start = time.monotonic()
watchdog = _C_testing._CollectiveWatchdog("group 'tp' (rank 0 of 2, fake)", 0.3, lambda: "",
                                  lambda: print("ABORT CALLED", flush=True), policy="env", poll_interval=0.01)
watchdog.watch("all_reduce", lambda: True, lambda: False)
time.sleep(30)
print("still alive", flush=True)
"""


def _run(env_value):
    env = dict(os.environ)
    env.pop("SHARDTORCH_ON_COMM_FAILURE", None)
    if env_value is not None:
        env["SHARDTORCH_ON_COMM_FAILURE"] = env_value
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _TERMINATE], env=env, capture_output=True, text=True,
                            timeout=60)
    return result, time.monotonic() - started


@pytest.mark.parametrize("env_value", [None, "terminate"])
def test_default_policy_terminates_the_process_with_the_message(env_value):
    result, seconds = _run(env_value)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "still alive" not in result.stdout
    assert "all_reduce #0 on group 'tp' (rank 0 of 2, fake) has not finished" in result.stderr
    assert "terminating this process" in result.stderr
    # ncclCommAbort can itself hang: terminating does not call it.
    assert "ABORT CALLED" not in result.stdout
    assert seconds < 20, seconds


def test_unknown_policy_is_an_error_naming_the_choices():
    result, _ = _run("ignore")
    assert result.returncode != 0
    assert "SHARDTORCH_ON_COMM_FAILURE must be 'terminate' (default) or 'raise', got 'ignore'" in result.stderr


_LAST_REFERENCE_ON_ITS_THREAD = """
import threading, time
from shardtorch import _C_testing
holder = [_C_testing._CollectiveWatchdog("group 'tp' (rank 0 of 2, fake)", 30.0, lambda: "", lambda: None,
                                 poll_interval=0.01)]
dropped = threading.Event()
def done():
    holder.clear()  # the last reference goes here, on the watchdog's own thread
    dropped.set()
    return True
holder[0].watch("all_reduce", lambda: True, done)
assert dropped.wait(10)
time.sleep(0.2)  # the thread finishes its poll and returns
print("exited cleanly", flush=True)
"""


def test_last_reference_dropped_on_the_watchdog_thread_ends_cleanly():
    """A watchdog destroyed from its own thread cannot join it; a std::thread destroyed joinable
    ends the process with SIGABRT ("terminate called without an active exception")."""
    result = subprocess.run([sys.executable, "-c", _LAST_REFERENCE_ON_ITS_THREAD], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    assert "exited cleanly" in result.stdout
    assert "terminate called" not in result.stderr
