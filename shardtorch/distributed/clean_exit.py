"""A job that ends without destroy_process_group must still exit with its own exit code.

Gloo's worker threads (torch's ``pt_gloo_runloop``) drop their reference to a finished
collective's tensors just after the caller's ``wait()`` returns; for a tensor that Python
also holds, that needs the GIL. If the main thread reaches interpreter finalization first
(a script whose last line is a collective ends within microseconds), CPython ends the worker
with ``pthread_exit`` when it asks for the GIL, the unwind meets torch's noexcept work
destructor and the process dies with "terminate called without an active exception"
(SIGABRT): 10 of 20 three-rank torchrun jobs here, with torch alone as well
(pytorch/pytorch#190489).

At exit, while the interpreter is still whole, this waits with the GIL released until none of
those threads is running (so each has taken the GIL it wanted and gone back to waiting for
work), bounded so that a thread stuck in a collective never holds the exit up. It changes no
state: the groups stay as they are, and a rank that raised still exits with its error's code.
"""
import atexit
import os
import time
from typing import Iterable

# Threads that drop tensors after a collective: torch's Gloo workers and shardtorch's
# watchdog (comm/watchdog.cpp names it).
_THREAD_PREFIXES = ("pt_gloo", "shardtorch_wdog")
_POLL_S = 0.002
# Quiet polls in a row before the exit goes on: one poll can fall between a worker's wake-up
# and its next step.
_QUIET_POLLS = 3
_LIMIT_S = 2.0


def _running_threads(prefixes: Iterable[str]) -> int:
    """How many threads of this process whose name starts with one of ``prefixes`` are
    runnable now (state R), read from /proc."""
    running = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        open_paren, close_paren = stat.find(b"("), stat.rfind(b")")
        name = stat[open_paren + 1:close_paren].decode(errors="replace")
        state = stat[close_paren + 2:close_paren + 3]
        if state == b"R" and name.startswith(tuple(prefixes)):
            running += 1
    return running


def _has_threads(prefixes: Iterable[str]) -> bool:
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                if f.read().decode(errors="replace").startswith(tuple(prefixes)):
                    return True
        except OSError:
            continue
    return False


def wait_for_collective_threads(limit_s: float = _LIMIT_S) -> bool:
    """Waits, with the GIL released, until no collective thread has run for a few polls, at most
    ``limit_s`` seconds. Returns whether they went quiet (True also when there are none)."""
    if not _has_threads(_THREAD_PREFIXES):
        return True
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < _QUIET_POLLS:
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)  # releases the GIL: a worker waiting for it takes it now
        quiet = quiet + 1 if _running_threads(_THREAD_PREFIXES) == 0 else 0
    return True


def _at_exit() -> None:
    try:
        wait_for_collective_threads()
    except Exception:  # never let the exit path itself fail
        pass


# Registered when shardtorch is imported, before the user's own handlers: atexit runs the
# last registered first, so this runs after theirs (which may still communicate).
atexit.register(_at_exit)
