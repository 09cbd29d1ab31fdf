"""Starting ranks as separate processes with torchrun's environment variables.

The one launcher of the distributed tests (tests/distributed/harness.py), the
C++ tests (tests/cpp) and the benchmarks (benchmarks/common.py): each rank gets
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a
free port; rank 0 serves the store) on one host, as torchrun would set them.
Only the standard library: the benchmarks load this file by path.
"""
import os
import socket
import subprocess
from typing import Callable, Iterable, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, env: Optional[dict] = None,
             pythonpath: Optional[str] = REPO) -> dict:
    """The environment of one rank: this process's, less an outer torchrun's
    TORCHELASTIC_* variables (these ranks have no agent and no agent store),
    with OMP_NUM_THREADS=1 (ranks share few cores), then ``env``, then the
    rank's torchrun variables; ``pythonpath`` goes first on PYTHONPATH."""
    result = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    result["OMP_NUM_THREADS"] = "1"
    result.update(env or {})
    result.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                   "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)})
    if pythonpath:
        result["PYTHONPATH"] = pythonpath + os.pathsep + result.get("PYTHONPATH", "")
    return result


def start_ranks(command: Iterable, world_size: int, env: Optional[dict] = None,
                pythonpath: Optional[str] = REPO, capture: bool = True, cwd: str = REPO,
                env_of_rank: Optional[Callable[[int], dict]] = None,
                spawn: Optional[Callable] = None) -> list:
    """Starts ``command`` once per rank; ``env_of_rank(rank)`` adds variables
    of one rank (e.g. where it writes its result). ``capture``: stdout and
    stderr together, as text, for wait_ranks; else they go to this process's.
    ``spawn(command, env, cwd, capture)``: another way to start a rank
    (the fork servers of tests/fork_server.py), returning a Popen-like object, or None
    for a plain subprocess.Popen."""
    port = free_port()
    command = [str(part) for part in command]
    procs = []
    for rank in range(world_size):
        extra = dict(env or {})
        extra.update(env_of_rank(rank) if env_of_rank else {})
        environment = rank_env(rank, world_size, port, extra, pythonpath)
        proc = spawn(command, environment, cwd, capture) if spawn is not None else None
        if proc is None:
            out = subprocess.PIPE if capture else None
            proc = subprocess.Popen(command, env=environment, cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT if capture else None, text=True)
        procs.append(proc)
    return procs


def wait_ranks(procs: List[subprocess.Popen], timeout: float, what: str) -> List[Tuple[int, Optional[str]]]:
    """[(returncode, output)] per rank. A rank not done within ``timeout``
    seconds (counted per rank, in order) is an error; no rank outlives this
    call."""
    results = []
    try:
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{what} on {len(procs)} ranks did not finish within {timeout}s") from None
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def run_ranks(command: Iterable, world_size: int, timeout: float, what: Optional[str] = None,
              **kwargs) -> List[Tuple[int, Optional[str]]]:
    """start_ranks, then wait_ranks: [(returncode, output)] per rank."""
    command = list(command)
    return wait_ranks(start_ranks(command, world_size, **kwargs), timeout, what or " ".join(map(str, command)))


def run_agents(commands: Iterable[Iterable], timeout: float, env: Optional[dict] = None,
               cwd: str = REPO) -> List[Tuple[int, str]]:
    """Starts one torchrun agent per command (the tests' stand-ins for nodes)
    with this process's environment plus ``env`` and the repository first on
    PYTHONPATH, waits for all, and returns [(returncode, output)] per agent. An
    agent not done within ``timeout`` seconds (counted per agent, in order) is
    killed and returns what it printed; no agent outlives this call."""
    environment = dict(os.environ, **(env or {}))
    environment["PYTHONPATH"] = REPO + os.pathsep + environment.get("PYTHONPATH", "")
    agents = [subprocess.Popen([str(part) for part in command], cwd=cwd, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for command in commands]
    results = []
    try:
        for agent in agents:
            try:
                out, _ = agent.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                agent.kill()
                out, _ = agent.communicate()
            results.append((agent.returncode, out))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    return results
