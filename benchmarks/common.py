"""Shared pieces of the benchmarks: launching ranks, timing side by side, and
measuring peak memory per rank.

Memory: the peak of tensor memory alive during the measured steps beyond what
was alive before them (parameters, inputs), per rank: on CPU counted exactly by
shardtorch's allocator tracking (shardtorch.utils.memory), on CUDA by the CUDA
caching allocator's statistics.
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _repo_path() -> str:
    """What the ranks' PYTHONPATH starts with: this checkout when its shardtorch
    holds the compiled core, else nothing (a git worktree has the sources but
    not _C*.so: putting it first would hide the installed, built shardtorch)."""
    built = any(name.startswith("_C") and name.endswith((".so", ".pyd"))
                for name in os.listdir(os.path.join(REPO, "shardtorch")))
    return REPO + os.pathsep if built else ""


def launch(script: str, world_size: int, args: list, timeout: float = 1800) -> list:
    """Runs ``script`` on ``world_size`` ranks (torchrun's environment) and
    returns each rank's JSON result (the script writes it to $BENCH_OUT)."""
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                       BENCH_OUT=os.path.join(out_dir, f"rank{rank}.json"),
                       PYTHONPATH=_repo_path() + os.environ.get("PYTHONPATH", ""))
            procs.append(subprocess.Popen([sys.executable, script] + [str(a) for a in args], env=env))
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"{script} {args} failed on a rank (exit {p.returncode})")
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


def write_result(result) -> None:
    with open(os.environ["BENCH_OUT"], "w") as f:
        json.dump(result, f)


def peak_memory(device: str):
    """Context manager measuring the peak extra tensor memory of a block
    (exact on CPU through shardtorch's allocator tracking; the CUDA allocator's
    own statistics on GPU)."""
    from shardtorch.utils.memory import PeakMemory
    return PeakMemory(device)


def time_interleaved(steps: dict, repeats: int, warmup: int = 2, sync=None, prepare=None) -> dict:
    """Median seconds per call of each step, run round-robin so that the
    machine's noise falls on every approach alike. ``prepare`` (name ->
    callable) runs before each call of that step, outside the timed region."""
    times = {name: [] for name in steps}
    for _ in range(warmup):
        for name, fn in steps.items():
            if prepare:
                prepare[name]()
            fn()
    for _ in range(repeats):
        for name, fn in steps.items():
            if prepare:
                prepare[name]()
            if sync:
                sync()
            start = time.perf_counter()
            fn()
            if sync:
                sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}
