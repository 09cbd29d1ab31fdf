"""Runs test cases in real processes: one launch of N ranks runs many cases,
of many case modules.

A case module (tests/distributed/cases_*.py) defines functions ``case_*`` that
run on every rank after ``shardtorch.distributed.init_process_group``. The
launcher starts the ranks as separate Python processes with torchrun's
environment variables (tests/launcher.py; forked from tests/fork_server.py's
servers where the environment allows), runs every requested case of every
requested module in each, and returns, per module and case, the error of any
rank (None when every rank passed).

Starting ranks is most of what a small case costs, so a pytest session
launches once per *launch key*: (world size, group size, environment, init).
``case_tests`` writes the tests of a module; before the first of them runs,
the session's ``launches`` (a LaunchCache) has read from the collected tests
which modules and cases each key needs, and the first test of a key launches
them all. A case that kills its process (or hangs past the timeout) fails
with the rank's output; the cases after it run in a new launch, so a crash
hides nothing. See tests/README.md.
"""
import atexit
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import pytest

from tests import fork_server
from tests.launcher import REPO, free_port, run_ranks  # noqa: F401  (free_port: for the tests' torchrun)

# Every rank of every launch finds this pytest session's scratch folder here
# (scratch_dir()); it is not part of the launch key.
SCRATCH_VARIABLE = "SHARDTORCH_TEST_SCRATCH"
_scratch: Optional[str] = None

Results = Dict[str, Optional[str]]  # case -> None (every rank passed) or the first failing rank's error
LaunchKey = Tuple[int, int, Tuple[Tuple[str, str], ...], bool]

# What each launch of this process cost, for pytest's --case-durations (case_durations_report):
# {"key", "what", "seconds" (the whole launch), "ready_after" (the slowest rank's start to its
# first case), "cases" ({(module, case): the slowest rank's seconds})}.
LAUNCH_TIMES: List[dict] = []


def case_names(module) -> list:
    """The ``case_*`` functions of ``module`` (a module or its dotted name), sorted."""
    if isinstance(module, str):
        module = importlib.import_module(module)
    return sorted(name for name in dir(module) if name.startswith("case_"))


def scratch_dir() -> str:
    """A folder shared by this pytest session and every rank it launches: case
    modules write reports there (os.environ[SCRATCH_VARIABLE]) that a test
    then reads. Removed when the session ends."""
    global _scratch
    if _scratch is None:
        _scratch = os.environ.get(SCRATCH_VARIABLE)
        if _scratch is None:
            _scratch = tempfile.mkdtemp(prefix="shardtorch-tests-")
            atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


def launch_key(world_size: int, group_size: Optional[int] = None, env: Optional[dict] = None,
               init: bool = True) -> LaunchKey:
    """What makes two launches interchangeable. ``group_size`` None is the whole world."""
    return (int(world_size), int(group_size or world_size), tuple(sorted((env or {}).items())), bool(init))


def _read_report(out_dir: str, rank: int) -> Optional[dict]:
    try:
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _launch_once(requests: Dict[str, List[str]], key: LaunchKey, timeout: float):
    """One launch: ([(returncode, output)] per rank or None on a timeout, the
    timeout's message or None, [the worker's report or None] per rank)."""
    world_size, group_size, env, init = key
    what = " + ".join(requests)
    with tempfile.TemporaryDirectory() as out_dir:
        # A rank that fails mid-collective must not stall its peers for long.
        rank_env = {"SHARDTORCH_TIMEOUT": os.environ.get("SHARDTORCH_TIMEOUT", "60"),
                    SCRATCH_VARIABLE: scratch_dir(), **dict(env)}
        command = [sys.executable, "-m", "tests.distributed.worker", json.dumps(sorted(requests.items())),
                   group_size, out_dir, "1" if init else "0"]
        ranks, timed_out = None, None
        started = time.monotonic()
        try:
            ranks = run_ranks(command, world_size, timeout, what=what, env=rank_env, spawn=fork_server.spawn)
        except RuntimeError as e:  # wait_ranks: a rank did not finish in time (all are killed)
            timed_out = str(e)
        reports = [_read_report(out_dir, rank) for rank in range(world_size)]
        _record_times(key, what, time.monotonic() - started, reports)
        return ranks, timed_out, reports


def _record_times(key: LaunchKey, what: str, seconds: float, reports: List[Optional[dict]]) -> None:
    cases: Dict[Tuple[str, str], float] = {}
    ready = [r["ready_after"] for r in reports if r and r.get("ready_after") is not None]
    for report in reports:
        for module, times in (report or {}).get("seconds", {}).items():
            for case, took in times.items():
                cases[(module, case)] = max(took, cases.get((module, case), 0.0))
    LAUNCH_TIMES.append({"key": key, "what": what, "seconds": seconds,
                         "ready_after": max(ready) if ready else None, "cases": cases})


def case_durations_report(count: int) -> List[str]:
    """Lines for the terminal summary: every launch (its key, seconds, start-up)
    and the ``count`` slowest cases (0: all), slowest first."""
    if not LAUNCH_TIMES:
        return []
    total = sum(launch["seconds"] for launch in LAUNCH_TIMES)
    in_cases = sum(sum(launch["cases"].values()) for launch in LAUNCH_TIMES)
    lines = [f"{len(LAUNCH_TIMES)} launches: {total:.1f} s, {in_cases:.1f} s of it in cases (the slowest rank's)"]
    for launch in sorted(LAUNCH_TIMES, key=lambda launch: -launch["seconds"]):
        world, group, env, init = launch["key"]
        ready = "?" if launch["ready_after"] is None else f"{launch['ready_after']:.1f}"
        lines.append(f"{launch['seconds']:7.2f}s  world {world} group {group}{' env ' + str(dict(env)) if env else ''}"
                     f"{'' if init else ' no-init'}: {len(launch['cases'])} case{'' if len(launch['cases']) == 1 else 's'}, first after {ready} s"
                     f" ({launch['what']})")
    cases = sorted(((took, module, case, launch["key"]) for launch in LAUNCH_TIMES
                    for (module, case), took in launch["cases"].items()), reverse=True)
    lines.append(f"slowest cases{'' if count == 0 else f' ({min(count, len(cases))} of {len(cases)})'}:")
    for took, module, case, (world, group, _, _) in (cases if count == 0 else cases[:count]):
        lines.append(f"{took:7.2f}s  {module}.{case} [{world}x{group}]")
    return lines


def _merge(reports: List[Optional[dict]]) -> Dict[str, Results]:
    merged: Dict[str, Results] = {}
    for rank, report in enumerate(reports):
        for module, results in (report or {}).get("results", {}).items():
            into = merged.setdefault(module, {})
            for case, error in results.items():
                if error is not None and into.get(case) is None:
                    into[case] = f"rank {rank}: {error}"
                else:
                    into.setdefault(case, None)
    return merged


def _crash(ranks, timed_out, reports, what: str) -> Optional[Tuple[str, Optional[Tuple[str, str]]]]:
    """(message, [module, case] being run or None) when the launch did not end
    cleanly on every rank, else None."""
    if timed_out is not None:
        running = next((tuple(r["running"]) for r in reports if r and r.get("running")), None)
        return timed_out, running
    failures, running = [], None
    for rank, (code, output) in enumerate(ranks):
        report = reports[rank]
        if code != 0 or report is None or report.get("running"):
            at = tuple(report["running"]) if report and report.get("running") else None
            running = running or at
            where = f" while running {at[0]}.{at[1]}" if at else ""
            failures.append(f"rank {rank} of {what} exited with {code}{where}:\n{output[-4000:]}")
    # Every failing rank: the one that died first is not always the first one.
    return ("\n\n".join(failures), running) if failures else None


def launch_modules(requests: Dict[str, Optional[Iterable[str]]], world_size: int, group_size: Optional[int] = None,
                   timeout: float = 900, init: bool = True, env: Optional[dict] = None,
                   keep_going: bool = False) -> Dict[str, Results]:
    """Runs ``requests`` ({module: cases, None for all}) on ``world_size`` ranks.

    Returns {module: {case: None if every rank passed, else the first failing
    rank's error}}. ``timeout`` is per module. When a rank crashes or the
    launch times out: ``keep_going`` False raises RuntimeError (the rank's exit
    code and output); True fails the case that was running with that message
    and runs the cases after it in a new launch."""
    key = launch_key(world_size, group_size, env, init)
    todo = {module: list(cases) if cases is not None else case_names(module) for module, cases in requests.items()}
    todo = {module: cases for module, cases in todo.items() if cases}
    out: Dict[str, Results] = {module: {} for module in requests}
    while todo:
        what = " + ".join(sorted(todo))
        ranks, timed_out, reports = _launch_once(todo, key, timeout * len(todo))
        for module, results in _merge(reports).items():
            out.setdefault(module, {}).update(results)
        crash = _crash(ranks, timed_out, reports, what)
        if crash is None:
            missing = {m: [c for c in cases if c not in out[m]] for m, cases in todo.items()}
            assert not any(missing.values()), f"{what}: the ranks skipped {missing}"
            break
        message, running = crash
        if not keep_going:
            raise RuntimeError(message)
        if running is not None:
            module, case = running
            earlier = out[module].get(case)
            out[module][case] = message + (f"\n\nwhat the case raised before: {earlier}" if earlier else "")
        left = {m: [c for c in cases if c not in out[m]] for m, cases in todo.items()}
        left = {m: cases for m, cases in left.items() if cases}
        if running is None or sum(map(len, left.values())) >= sum(map(len, todo.values())):
            # Crashed outside any case (start-up, teardown): nothing to isolate.
            for module, cases in left.items():
                out[module].update({case: message for case in cases})
            break
        todo = left
    return out


def check_phases(module: str, phases: Dict[str, Tuple[int, int, List[str]]]) -> None:
    """Asserts that ``phases`` ({phase: (world, group, cases)}, run in order by
    a test that launches each) lists every case of ``module`` and no other: a
    case in no phase would otherwise never run."""
    listed = {case for _, _, cases in phases.values() for case in cases}
    defined = set(case_names(module))
    assert not defined - listed, f"{module}: cases in no phase, never run: {sorted(defined - listed)}"
    assert not listed - defined, f"{module}: phases list cases it does not define: {sorted(listed - defined)}"


def launch(module: str, world_size: int, group_size: Optional[int] = None,
           cases: Optional[Iterable[str]] = None, timeout: float = 900,
           init: bool = True, env: Optional[dict] = None) -> Results:
    """Runs ``cases`` of ``module`` (dotted name; all when None) on
    ``world_size`` ranks, in a launch of its own.

    Returns {case: None if every rank passed, else the first rank's error}.
    Raises if the ranks themselves crash or time out."""
    return launch_modules({module: cases}, world_size, group_size, timeout=timeout, init=init, env=env)[module]


def run_script(script: str, world_size: int, args=(), env: Optional[dict] = None,
               timeout: float = 300) -> list:
    """Runs a standalone script on ``world_size`` ranks (torchrun's variables)
    and returns [(returncode, output)] per rank, for tests where ranks are meant
    to die or disagree and the case-runner's barriers cannot be used."""
    return run_ranks([sys.executable, script, *args], world_size, timeout, what=script, env=env,
                     spawn=fork_server.spawn)


# (module, world size, group size, cases or None, env, init): what one test reads.
Request = Tuple[str, int, Optional[int], Optional[List[str]], Optional[dict], bool]


class LaunchCache:
    """The session's launches: each requested case runs once, and every module
    of one launch key runs in the same launch.

    ``expected``: the requests of the tests pytest will run (expected_requests),
    so that the first test of a key launches what the others of that key need."""

    def __init__(self, expected: Iterable[Request] = ()):
        self._results: Dict[LaunchKey, Dict[str, Results]] = {}
        self._pending: Dict[LaunchKey, Dict[str, set]] = {}
        for request in expected:
            self.expect(*request)

    def expect(self, module: str, world_size: int, group_size: Optional[int] = None,
               cases: Optional[Iterable[str]] = None, env: Optional[dict] = None, init: bool = True) -> None:
        key = launch_key(world_size, group_size, env, init)
        names = list(cases) if cases is not None else case_names(module)
        self._pending.setdefault(key, {}).setdefault(module, set()).update(names)

    def get(self, module: str, world_size: int, group_size: Optional[int] = None,
            cases: Optional[Iterable[str]] = None, env: Optional[dict] = None, init: bool = True,
            timeout: float = 900) -> Results:
        """{case: error or None} for ``cases`` of ``module`` (all when None) and
        whatever else of the module already ran at this key."""
        key = launch_key(world_size, group_size, env, init)
        done = self._results.setdefault(key, {})
        wanted = list(cases) if cases is not None else case_names(module)
        if any(case not in done.get(module, {}) for case in wanted):
            requests = self._pending.pop(key, {})
            requests.setdefault(module, set()).update(wanted)
            requests = {m: sorted(set(c) - set(done.get(m, {}))) for m, c in requests.items()}
            ran = launch_modules({m: c for m, c in requests.items() if c}, world_size, group_size,
                                 timeout=timeout, init=init, env=env, keep_going=True)
            for m, results in ran.items():
                done.setdefault(m, {}).update(results)
        return dict(done[module])


def _add_requests(test: Callable, requests_of: Callable[[dict], List[Request]]) -> None:
    previous = getattr(test, "launch_requests", None)
    test.launch_requests = (lambda params: previous(params) + requests_of(params)) if previous else requests_of


def reads_launch(module: str, world_size: int, group_size: Optional[int] = None,
                 cases: Union[None, Iterable[str], Callable[[dict], List[str]]] = None,
                 env: Optional[dict] = None, init: bool = True):
    """Marks a test that calls ``launches.get`` itself with these arguments, so
    that its launch is shared with the other tests of the same key. ``cases``:
    None for all, or a list, or a function of the test's parameters giving one."""
    def requests_of(params):
        names = cases(params) if callable(cases) else (list(cases) if cases is not None else None)
        return [(module, world_size, group_size, names, env, init)]

    def mark(test):
        _add_requests(test, requests_of)
        return test
    return mark


def expected_requests(items) -> List[Request]:
    """The launch requests of the collected (and selected) pytest items."""
    requests = []
    for item in items:
        requests_of = getattr(getattr(item, "function", None), "launch_requests", None)
        if requests_of is not None:
            callspec = getattr(item, "callspec", None)
            requests.extend(requests_of(dict(callspec.params) if callspec else {}))
    return requests


def case_tests(module: str, world_size: Union[int, Sequence[int]] = (2, 4),
               group_size: Union[None, int, Sequence[int]] = None, cases: Optional[Iterable[str]] = None,
               env: Optional[dict] = None, init: bool = True):
    """A pytest test that runs every case of ``module`` (or ``cases``), one
    test per case, from the session's shared launches (one per launch key).

    ``world_size`` and ``group_size`` are ints, or one of them a sequence of
    sizes to run at: the test ids are then ``[case-size]``, else ``[case]``.
    ``group_size`` None: one tensor-parallel group of the whole world.
    ``env``: variables the ranks need (part of the launch key: modules with
    different ``env`` never share a launch)."""
    names = sorted(cases) if cases is not None else case_names(module)
    varied = [name for name, value in (("world", world_size), ("group", group_size))
              if isinstance(value, (list, tuple))]
    assert len(varied) <= 1, "case_tests: vary the world size or the group size, not both"

    def sizes_of(size):
        world = size if varied == ["world"] else world_size
        group = size if varied == ["group"] else group_size
        return world, group

    def requests_of(params):
        world, group = sizes_of(params.get("size"))
        return [(module, world, group, [params["case"]], env, init)]

    def run(launches, case, size=None):
        world, group = sizes_of(size)
        results = launches.get(module, world, group, cases=[case], env=env, init=init)
        assert results[case] is None, results[case]

    if varied:
        def test(launches, case, size):
            run(launches, case, size)
        _add_requests(test, requests_of)
        sizes = world_size if varied == ["world"] else group_size
        return pytest.mark.parametrize("size", list(sizes))(pytest.mark.parametrize("case", names)(test))

    def test(launches, case):
        run(launches, case)
    _add_requests(test, requests_of)
    return pytest.mark.parametrize("case", names)(test)
