"""Shared pieces of the benchmarks: launching ranks, timing side by side, and
measuring peak memory per rank.

Memory: the peak of tensor memory alive during the measured steps beyond what
was alive before them (parameters, inputs), per rank: on CPU counted exactly by
shardtorch's allocator tracking (shardtorch.utils.memory), on CUDA by the CUDA
caching allocator's statistics.
"""
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The instructions that change the figures most (AMX and AVX512-BF16 make bfloat16 GEMMs several
# times faster than float32 ones; without them they are emulated and slower).
_FIGURE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_name() -> str:
    """The CPU's model name and its vector extensions that matter here, to print beside every
    figure (machines differ: the same model name comes with and without AMX)."""
    name, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if name is None and line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif flags is None and line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    name = name or platform.processor() or "unknown CPU"
    if flags is None:
        return name
    return f"{name} [{' '.join(f if f in flags else 'no-' + f for f in _FIGURE_FLAGS)}]"


def _load_launcher():
    """tests/launcher.py, the ranks launcher the tests use, loaded by path: putting
    the checkout on sys.path would put its unbuilt shardtorch there too."""
    spec = importlib.util.spec_from_file_location("_shardtorch_launcher", os.path.join(REPO, "tests", "launcher.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_launcher = _load_launcher()


def _repo_path():
    """What the ranks' PYTHONPATH starts with: this checkout when its shardtorch
    holds the compiled core, else nothing (a git worktree has the sources but
    not _C*.so: putting it first would hide the installed, built shardtorch)."""
    built = any(name.startswith("_C") and name.endswith((".so", ".pyd"))
                for name in os.listdir(os.path.join(REPO, "shardtorch")))
    return REPO if built else None


def launch(script: str, world_size: int, args: list, timeout: float = 1800) -> list:
    """Runs ``script`` on ``world_size`` ranks (torchrun's environment) and
    returns each rank's JSON result (the script writes it to $BENCH_OUT)."""
    with tempfile.TemporaryDirectory() as out_dir:
        def result_path(rank):
            return os.path.join(out_dir, f"rank{rank}.json")

        ranks = _launcher.run_ranks(
            [sys.executable, script, *args], world_size, timeout, capture=False, cwd=None,
            pythonpath=_repo_path(), env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            env_of_rank=lambda rank: {"BENCH_OUT": result_path(rank)})
        for code, _ in ranks:
            if code != 0:
                raise RuntimeError(f"{script} {args} failed on a rank (exit {code})")
        results = []
        for rank in range(world_size):
            with open(result_path(rank)) as f:
                results.append(json.load(f))
        return results


def world_of_one(prefix: str = "shardtorch-bench-") -> None:
    """A world of one rank in this process (Gloo over a FileStore in a fresh
    temporary path) and shardtorch's groups on it, for one-process benchmarks."""
    import torch.distributed as dist

    import shardtorch as ts
    fd, path = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    ts.distributed.init_process_group(group_size=1)


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


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM: resident memory now and at its highest)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_resident_memory() -> int:
    """Resets the kernel's high-water mark of resident memory (VmHWM) to the current VmRSS; returns it (KiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")


def llama_checkpoint(path: str, config: dict) -> None:
    """Writes a Llama-style checkpoint of ``config`` (float32, seed 0) with save_pretrained, once."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(path)


def time_spent_in(owner, *names: str) -> list:
    """Wraps the functions ``owner.<name>`` so that the seconds spent in them add up in the one-element list
    returned (reset it by assigning [0] = 0.0): how long a step inside a library call takes, timed where it
    runs."""
    spent = [0.0]

    def timed(step):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return run
    for name in names:
        setattr(owner, name, timed(getattr(owner, name)))
    return spent
