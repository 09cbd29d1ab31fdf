"""Runs test cases in real processes: one launch of N ranks runs many cases.

A case module (tests/distributed/cases_*.py) defines functions ``case_*`` that
run on every rank after ``shardtorch.distributed.init_process_group``. The
launcher starts the ranks as separate Python processes with torchrun's
environment variables, runs every requested case in each, and returns, per case,
the error of any rank (None when every rank passed). pytest tests then assert
case by case, so one launch serves many tests.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        port = free_port()
        procs = []
        for rank in range(world_size):
            rank_env = dict(os.environ)
            rank_env.update(env or {})
            rank_env.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                # A rank that fails mid-collective must not stall its peers for long.
                "SHARDTORCH_TIMEOUT": rank_env.get("SHARDTORCH_TIMEOUT", "60"),
                "PYTHONPATH": REPO + os.pathsep + rank_env.get("PYTHONPATH", ""),
            })
            cmd = [sys.executable, "-m", "tests.distributed.worker", module, str(group_size),
                   ",".join(cases or []), out_dir, "1" if init else "0"]
            procs.append(subprocess.Popen(cmd, env=rank_env, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outputs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=timeout)
                outputs.append(out)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{module} on {world_size} ranks timed out after {timeout}s")
        results: Dict[str, Optional[str]] = {}
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of {module} exited with {procs[rank].returncode} "
                                   f"and no results:\n{outputs[rank][-6000:]}")
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
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ)
        rank_env.update(env or {})
        rank_env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                         "PYTHONPATH": REPO + os.pathsep + rank_env.get("PYTHONPATH", "")})
        procs.append(subprocess.Popen([sys.executable, script, *map(str, args)], env=rank_env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{script} on {world_size} ranks did not finish within {timeout}s")
        results.append((p.returncode, out))
    return results


class LaunchCache:
    """Launches each (module, world, group) once per pytest session."""

    def __init__(self):
        self._results = {}

    def get(self, module: str, world_size: int, group_size: Optional[int] = None, **kwargs):
        key = (module, world_size, group_size, tuple(sorted(kwargs.get("env", {}).items())),
               kwargs.get("init", True))
        if key not in self._results:
            self._results[key] = launch(module, world_size, group_size, **kwargs)
        return self._results[key]
