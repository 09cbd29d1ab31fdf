"""The C++ API as a LibTorch user meets it: tests/cpp and examples/cpp are
configured with find_package(shardtorch) against the installed package and
built once per session (Ninja, build/cpp-api/), then run: the unit tests, the
ops under --as-needed, the communicators and the example on 2 ranks (torchrun
--no-python), and a TorchScript module saved here and trained in C++."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import shardtorch
from tests.launcher import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_ROOT = os.path.join(REPO, "build", "cpp-api")
RUN_TIMEOUT = 180
STEP_LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def _built_with_gloo() -> bool:
    header = os.path.join(shardtorch.cmake_prefix_path, "include", "shardtorch", "build_info.h")
    with open(header) as f:
        return "kBuiltWithGloo = true" in f.read()


def _run(cmd, timeout, what, **kwargs):
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} timed out after {timeout}s:\n{(e.output or '')[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({proc.returncode}) after {time.monotonic() - start:.0f}s: "
                    f"{' '.join(cmd)}\n{proc.stdout[-6000:]}")
    return proc.stdout


def _configure_and_build(source: str, build_dir: str, *extra_args: str) -> None:
    prefix = shardtorch.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path
    # ccache (CMakeLists.txt's launcher) keys on paths relative to the checkout, as scripts/setup.sh's
    # build does: a fresh clone (CI's) then reuses the objects another clone compiled from the same
    # sources and headers (its venv is inside the checkout too) instead of compiling for a minute.
    env = dict(os.environ, CCACHE_BASEDIR=REPO)
    # -O1: these programs test correctness; compiling them is most of the time.
    _run(["cmake", "-S", source, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
          "-DCMAKE_CXX_FLAGS_RELEASE=-O1", f"-DCMAKE_PREFIX_PATH={prefix}", *extra_args],
         300, f"configuring {source}", env=env)
    _run(["cmake", "--build", build_dir, "--parallel", str(min(2, os.cpu_count() or 1))], 900,
         f"building {source}", env=env)


def _torchrun_wrapper() -> str:
    """torchrun for this interpreter (the one on PATH may belong to another venv)."""
    path = os.path.join(BUILD_ROOT, "torchrun")
    os.makedirs(BUILD_ROOT, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec '{sys.executable}' -m torch.distributed.run \"$@\"\n")
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="session")
def cpp_build():
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("cmake and ninja are needed to build the C++ tests")
    builds = {name: os.path.join(BUILD_ROOT, name) for name in ("tests", "examples")}
    # ctest (tests/cpp) launches its multi-rank tests with this interpreter's torchrun.
    _configure_and_build(os.path.join(REPO, "tests", "cpp"), builds["tests"],
                         f"-DSHARDTORCH_TORCHRUN={_torchrun_wrapper()}")
    _configure_and_build(os.path.join(REPO, "examples", "cpp"), builds["examples"])
    return builds


def _env():
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "SHARDTORCH_TIMEOUT": "60"})
    return env


def _torchrun(program, *args, python=False, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if not python:
        cmd.append("--no-python")
    return _run(cmd + [program, *map(str, args)], RUN_TIMEOUT, f"{program} on {nproc} ranks",
                env=_env(), cwd=REPO)


def _losses(output):
    losses = [(int(step), float(loss)) for step, loss in STEP_LOSS.findall(output)]
    assert [s for s, _ in losses] == list(range(len(losses))), output[-3000:]
    return [loss for _, loss in losses]


def _needs_gloo():
    if not _built_with_gloo():
        pytest.skip("libshardtorch was built without Gloo headers (libgloo-dev): no C++ init")


def test_topology_and_exact_init(cpp_build):
    out = _run([os.path.join(cpp_build["tests"], "test_topology")], RUN_TIMEOUT, "test_topology")
    assert "0 failed" in out, out


def test_installed_headers_are_the_public_api(cpp_build):
    """The package installs the public API under include/shardtorch only: no
    internal folders (communicators, autograd, kernels, bindings) and nothing
    directly under include/ but shardtorch/; each public header compiles from
    that include path on its own (test_public_headers)."""
    include = os.path.join(shardtorch.cmake_prefix_path, "include")
    assert os.listdir(include) == ["shardtorch"], os.listdir(include)
    installed = set()
    for root, _, files in os.walk(include):
        installed.update(os.path.relpath(os.path.join(root, f), include) for f in files)
    for internal in ("comm/", "autograd/", "python/", "utils/", "ops/cpu/", "ops/cuda/",
                     "ops/meta/", "ops/autocast/", "_impl.h", "op_checks.h", "statistics.h"):
        assert not any(internal in path for path in installed), (internal, sorted(installed))
    assert "shardtorch/shardtorch.h" in installed and "shardtorch/nn/parallel_linear.h" in installed
    out = _run([os.path.join(cpp_build["tests"], "test_public_headers")], RUN_TIMEOUT,
               "test_public_headers")
    assert ", 0 failed" in out, out


def test_ops_registered_when_linked_as_needed(cpp_build):
    out = _run([os.path.join(cpp_build["tests"], "test_ops_registered")], RUN_TIMEOUT,
               "test_ops_registered")
    assert "0 missing" in out, out


@pytest.mark.parametrize("world_size,group_size", [(2, 2), (4, 2)])
def test_communicators(cpp_build, world_size, group_size):
    """Groups, every collective, the mappings and ParallelLinear; world 4 is
    2 data-parallel x 2 tensor-parallel groups."""
    _needs_gloo()
    out = _torchrun(os.path.join(cpp_build["tests"], "test_communicators"), group_size,
                    nproc=world_size)
    assert out.count(", 0 failed") == world_size, out


def test_example_matches_python_twin(cpp_build):
    _needs_gloo()
    steps = 20
    cpp = _losses(_torchrun(os.path.join(cpp_build["examples"], "train_classifier"), steps))
    python = _losses(_torchrun(os.path.join(REPO, "examples", "python", "train_classifier_twin.py"),
                               steps, python=True))
    assert len(cpp) == len(python) == steps
    assert python[-1] < 0.75 * python[0], f"the twin does not learn: {python}"
    torch.testing.assert_close(torch.tensor(cpp, dtype=torch.float64),
                               torch.tensor(python, dtype=torch.float64), rtol=1e-5, atol=1e-6)


class _TinyShardedClassifier(nn.Module):
    """Column- then row-parallel layers and the loss, through torch.ops.shard."""

    def __init__(self, first: nn.Linear, second: nn.Linear, rank: int, size: int):
        super().__init__()
        hidden = first.out_features
        lo = shardtorch._C.shard_offset(hidden, size, rank)
        hi = lo + shardtorch._C.shard_size(hidden, size, rank)
        self.w1 = nn.Parameter(first.weight.detach()[lo:hi].clone())
        self.b1 = nn.Parameter(first.bias.detach()[lo:hi].clone())
        self.w2 = nn.Parameter(second.weight.detach()[:, lo:hi].clone())
        self.b2 = nn.Parameter(second.bias.detach().clone())

    def forward(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(torch.ops.shard.parallel_linear(features, self.w1, self.b1, 1, "tp"))
        logits = torch.ops.shard.parallel_linear(hidden, self.w2, self.b2, 0, "tp")
        return nn.functional.cross_entropy(logits, targets)


def test_torchscript_module_trains_in_cpp(cpp_build, tmp_path):
    _needs_gloo()
    steps, size = 3, 2
    torch.manual_seed(5)
    first, second = nn.Linear(8, 7), nn.Linear(7, 4)  # 7 hidden: shards of 4 and 3
    prefix = str(tmp_path / "tiny")
    for rank in range(size):
        scripted = torch.jit.script(_TinyShardedClassifier(first, second, rank, size))
        scripted.save(f"{prefix}_rank{rank}.pt")
    cpp = _losses(_torchrun(os.path.join(cpp_build["tests"], "jit_train"), prefix, steps))

    # The same training, unsharded, in Python (data drawn as jit_train draws it).
    torch.manual_seed(7)
    features, targets = torch.randn(8, 8), torch.randint(0, 4, (8,))
    model = nn.Sequential(first, nn.ReLU(), second)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    expected = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(features), targets)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert len(cpp) == steps
    torch.testing.assert_close(torch.tensor(cpp, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_communicators_without_torchrun(cpp_build):
    """The launcher-free way: each rank gets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT; rank 0 then serves the TCPStore itself."""
    _needs_gloo()
    program = os.path.join(cpp_build["tests"], "test_communicators")
    ranks = run_ranks([program, "2"], 2, RUN_TIMEOUT, env={"SHARDTORCH_TIMEOUT": "60"}, pythonpath=None)
    for rank, (code, out) in enumerate(ranks):
        assert code == 0 and ", 0 failed" in out, f"rank {rank}:\n{out[-4000:]}"
