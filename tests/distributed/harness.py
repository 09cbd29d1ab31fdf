"""Runs test cases in real processes: one launch of N ranks runs many cases.

A case module (tests/distributed/cases_*.py) defines functions ``case_*`` that
run on every rank after ``shardtorch.distributed.init_process_group``. The
launcher starts the ranks as separate Python processes with torchrun's
environment variables (tests/launcher.py), runs every requested case in each,
and returns, per case, the error of any rank (None when every rank passed).
pytest tests then assert case by case, so one launch serves many tests;
``case_tests`` writes such a test.
"""
import importlib
import json
import os
import sys
import tempfile
from typing import Dict, Iterable, Optional, Sequence, Union

import pytest

from tests.launcher import REPO, free_port, run_ranks  # noqa: F401  (free_port: for the tests' torchrun)


def case_names(module) -> list:
    return sorted(name for name in dir(module) if name.startswith("case_"))


def launch(module: str, world_size: int, group_size: Optional[int] = None,
           cases: Optional[Iterable[str]] = None, timeout: float = 900,
           init: bool = True, env: Optional[dict] = None) -> Dict[str, Optional[str]]:
    """Runs ``cases`` of ``module`` (dotted name) on ``world_size`` ranks.

    Returns {case: None if every rank passed, else the first rank's error}.
    Raises if the ranks themselves crash or time out.
    """
    group_size = group_size or world_size
    with tempfile.TemporaryDirectory() as out_dir:
        # A rank that fails mid-collective must not stall its peers for long.
        rank_env = {"SHARDTORCH_TIMEOUT": os.environ.get("SHARDTORCH_TIMEOUT", "60"), **(env or {})}
        command = [sys.executable, "-m", "tests.distributed.worker", module, group_size,
                   ",".join(cases or []), out_dir, "1" if init else "0"]
        ranks = run_ranks(command, world_size, timeout, what=module, env=rank_env)
        results: Dict[str, Optional[str]] = {}
        for rank, (code, output) in enumerate(ranks):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of {module} exited with {code} "
                                   f"and no results:\n{output[-6000:]}")
            with open(path) as f:
                for case, error in json.load(f).items():
                    if error is not None and results.get(case) is None:
                        results[case] = f"rank {rank}: {error}"
                    else:
                        results.setdefault(case, None)
        return results


def run_script(script: str, world_size: int, args=(), env: Optional[dict] = None,
               timeout: float = 300) -> list:
    """Runs a standalone script on ``world_size`` ranks (torchrun's variables)
    and returns [(returncode, output)] per rank, for tests where ranks are meant
    to die or disagree and the case-runner's barriers cannot be used."""
    return run_ranks([sys.executable, script, *args], world_size, timeout, what=script, env=env)


class LaunchCache:
    """Launches each (module, world, group) once per pytest session."""

    def __init__(self):
        self._results = {}

    def get(self, module: str, world_size: int, group_size: Optional[int] = None, **kwargs):
        key = (module, world_size, group_size, tuple(sorted((kwargs.get("env") or {}).items())),
               kwargs.get("init", True))
        if key not in self._results:
            self._results[key] = launch(module, world_size, group_size, **kwargs)
        return self._results[key]


def case_tests(module: str, world_size: Union[int, Sequence[int]] = (2, 4),
               group_size: Union[None, int, Sequence[int]] = None, cases: Optional[Iterable[str]] = None,
               env: Optional[dict] = None, init: bool = True):
    """A pytest test that runs every case of ``module`` (or ``cases``), one
    test per case, from one launch per size (the session's ``launches``).

    ``world_size`` and ``group_size`` are ints, or one of them a sequence of
    sizes to run at: the test ids are then ``[case-size]``, else ``[case]``.
    ``group_size`` None: one tensor-parallel group of the whole world."""
    names = sorted(cases) if cases is not None else case_names(importlib.import_module(module))
    varied = [name for name, value in (("world", world_size), ("group", group_size))
              if isinstance(value, (list, tuple))]
    assert len(varied) <= 1, "case_tests: vary the world size or the group size, not both"

    def run(launches, case, size=None):
        world = size if varied == ["world"] else world_size
        group = size if varied == ["group"] else group_size
        results = launches.get(module, world, group, env=env, init=init)
        assert results[case] is None, results[case]

    if varied:
        def test(launches, case, size):
            run(launches, case, size)
        sizes = world_size if varied == ["world"] else group_size
        return pytest.mark.parametrize("size", list(sizes))(pytest.mark.parametrize("case", names)(test))

    def test(launches, case):
        run(launches, case)
    return pytest.mark.parametrize("case", names)(test)
