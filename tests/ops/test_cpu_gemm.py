"""The CPU GEMMs of the linear layers and the fused heads (csrc/ops/cpu/cpu_gemm.h): float32 ones go
through oneDNN's matmul where MKL's sgemm runs narrower than the CPU (an AVX-512 CPU not made by
Intel) and are big enough to pay for it, through ATen's mm elsewhere; SHARDTORCH_CPU_FLOAT32_GEMMS
(auto, onednn, blas) overrides. Each path against float64 (the op shard::_cpu_gemm_ alone: strided
outputs, transposed operands, accumulation; the parallel linear layer, the fused linear
cross-entropy and the margin loss, forward and backward), and the automatic choice against what
/proc/cpuinfo and torch's build say. Which library ran is read from the profiler: ATen's GEMMs
record aten::mm / aten::addmm, oneDNN's matmul records none."""
import os
import platform
import subprocess
import sys

import pytest
import torch
from torch.profiler import profile

import shardtorch as ts
from tests.ops.test_autocast import GEMMS
from tests.launcher import REPO
from tests.reference import cross_entropy_reference, margin_cross_entropy_reference

VARIABLE = "SHARDTORCH_CPU_FLOAT32_GEMMS"
OP = torch.ops.shard._cpu_gemm_
ONEDNN_MIN_PRODUCT = 1 << 21  # m * k * n from which `auto` takes oneDNN (cpu_gemm.cpp)


def _cpuinfo():
    vendor, flags = "", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("vendor_id") and not vendor:
                vendor = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return vendor, flags


def _onednn_runs():
    """Whether torch's oneDNN takes float32 GEMMs here: x86-64 with AVX-512 F/BW/VL/DQ."""
    if platform.machine() not in ("x86_64", "AMD64") or not torch.backends.mkldnn.is_available():
        return False
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= _cpuinfo()[1]


def _auto_takes_onednn():
    """The automatic choice: oneDNN where MKL runs narrower than the CPU (not an Intel CPU)."""
    return _onednn_runs() and torch.backends.mkl.is_available() and _cpuinfo()[0] != "GenuineIntel"


needs_onednn = pytest.mark.skipif(not _onednn_runs(), reason="torch's oneDNN takes no float32 GEMMs on this CPU")
CHOICES = ["blas", pytest.param("onednn", marks=needs_onednn)]


def _aten_gemms(fn):
    """fn()'s result and the number of ATen GEMM calls it made."""
    with profile() as prof:
        out = fn()
    return out, sum(1 for e in prof.profiler.kineto_results.events() if e.name() in GEMMS)


@pytest.mark.parametrize("asked", CHOICES)
@pytest.mark.parametrize("layout", ["plain", "transposed a", "transposed b", "strided out", "accumulate"])
def test_the_op_is_the_float64_product(monkeypatch, asked, layout):
    monkeypatch.setenv(VARIABLE, asked)
    g = torch.Generator().manual_seed(0)
    m, k, n = 37, 129, 301
    a = torch.randn(k, m, generator=g).t() if layout == "transposed a" else torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g).t() if layout == "transposed b" else torch.randn(k, n, generator=g)
    want = a.double() @ b.double()
    wide = torch.full((m, n + 20), float("nan"))
    out = wide[:, 7:7 + n] if layout == "strided out" else torch.full((m, n), float("nan"))
    if layout == "accumulate":
        out = torch.randn(m, n, generator=g)
        want = want + out.double()
    _, calls = _aten_gemms(lambda: OP(out, a, b, layout == "accumulate"))
    assert calls == (1 if asked == "blas" else 0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    if layout == "strided out":
        assert wide[:, :7].isnan().all() and wide[:, 7 + n:].isnan().all(), "columns outside out were written"


@pytest.mark.parametrize("asked", CHOICES)
@pytest.mark.parametrize("m,k,n", [(0, 4, 3), (3, 0, 5), (4, 5, 0), (1, 1, 1)])
def test_empty_and_tiny_products(monkeypatch, asked, m, k, n):
    monkeypatch.setenv(VARIABLE, asked)
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.full((m, n), float("nan"))
    OP(out, a, b)
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("asked", [None, "auto"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_the_automatic_choice_follows_the_cpu_and_the_size(monkeypatch, asked, size):
    if asked is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, asked)
    m, k, n = (64, 64, 64) if size == "small" else (128, 128, 256)
    assert (m * k * n >= ONEDNN_MIN_PRODUCT) == (size == "large")
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    _, calls = _aten_gemms(lambda: OP(out, a, b))
    onednn = size == "large" and _auto_takes_onednn()
    assert calls == (0 if onednn else 1)
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-4)


def test_other_dtypes_stay_with_aten(monkeypatch):
    monkeypatch.setenv(VARIABLE, "onednn")
    a, b = torch.randn(16, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    out = torch.empty(16, 4, dtype=torch.float64)
    _, calls = _aten_gemms(lambda: OP(out, a, b))
    assert calls == 1 and torch.equal(out, a @ b)


def test_bad_arguments_and_choices_fail_by_name(monkeypatch):
    monkeypatch.setenv(VARIABLE, "mkl")
    with pytest.raises(RuntimeError, match=f"{VARIABLE} must be auto, onednn or blas, got 'mkl'"):
        OP(torch.empty(2, 2), torch.randn(2, 3), torch.randn(3, 2))
    monkeypatch.setenv(VARIABLE, "blas")
    with pytest.raises(RuntimeError, match="shapes do not multiply"):
        OP(torch.empty(2, 2), torch.randn(2, 3), torch.randn(2, 2))
    with pytest.raises(RuntimeError, match="must be in out's dtype"):
        OP(torch.empty(2, 2), torch.randn(2, 3, dtype=torch.float64), torch.randn(3, 2))
    a = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        OP(a, a, torch.randn(4, 4))


@pytest.mark.skipif(_onednn_runs(), reason="this CPU runs oneDNN's float32 GEMMs: the refusal is for CPUs without")
def test_asking_for_onednn_where_it_cannot_run_is_refused(monkeypatch):
    monkeypatch.setenv(VARIABLE, "onednn")
    with pytest.raises(RuntimeError, match=f"{VARIABLE}=onednn, but "):
        OP(torch.empty(2, 2), torch.randn(2, 3), torch.randn(3, 2))


CAPPED = """
import torch, shardtorch
from tests.ops.test_cpu_gemm import _aten_gemms
a, b, out = torch.randn(128, 128), torch.randn(128, 256), torch.empty(128, 256)
_, calls = _aten_gemms(lambda: torch.ops.shard._cpu_gemm_(out, a, b))
print("aten gemms", calls, torch.allclose(out, a @ b, rtol=1e-4, atol=1e-4))
import os
os.environ["SHARDTORCH_CPU_FLOAT32_GEMMS"] = "onednn"
try:
    torch.ops.shard._cpu_gemm_(out, a, b)
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""


@needs_onednn
def test_a_onednn_capped_below_avx512_leaves_the_gemms_to_aten():
    """ONEDNN_MAX_CPU_ISA=AVX2 makes torch's oneDNN refuse float32 GEMMs (its AVX-512 check follows
    the cap, not the CPU): the automatic choice must then keep ATen's, and asking for oneDNN fails
    by name, instead of every large GEMM raising."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(VARIABLE, None)
    done = subprocess.run([sys.executable, "-c", CAPPED], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "aten gemms 1 True", done.stdout
    assert lines[1].startswith(f"{VARIABLE}=onednn, but torch's oneDNN refuses float32 GEMMs here"), done.stdout


def test_a_torch_with_onednn_disabled_keeps_aten(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    a, b, out = torch.randn(128, 128), torch.randn(128, 256), torch.empty(128, 256)
    with torch.backends.mkldnn.flags(enabled=False):
        _, calls = _aten_gemms(lambda: OP(out, a, b))
    assert calls == 1
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-4)


def _float32_inputs(rows, classes, features, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g)
    w = torch.randn(classes, features, generator=g) / features ** 0.5
    return x, w, torch.randint(0, classes, (rows,), generator=g)


def _step(loss_fn, *leaves):
    leaves = [t.clone().requires_grad_() for t in leaves]
    loss = loss_fn(*leaves)
    loss.backward()
    return [loss.detach()] + [t.grad.to_dense() for t in leaves]


def _check_against_float64(asked, monkeypatch, ours, reference, leaves):
    monkeypatch.setenv(VARIABLE, asked)
    got, calls = _aten_gemms(lambda: _step(ours, *leaves))
    assert (calls > 0) == (asked == "blas"), calls
    want = _step(reference, *[t.double() for t in leaves])
    for name, a, b in zip(["loss", "input grad", "weight grad", "bias grad"], got, want):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("asked", CHOICES)
def test_the_margin_loss_is_float64s_through_either_library(monkeypatch, asked):
    x, w, target = _float32_inputs(96, 3000, 64, 1)
    margins = (1.0, 0.3, 0.1)
    _check_against_float64(
        asked, monkeypatch,
        lambda x, w: ts.nn.functional.parallel_margin_cross_entropy(x, w, target, 16.0, margins, chunk_size=1024),
        lambda x, w: margin_cross_entropy_reference(x, w, target, 16.0, margins), [x, w])


@pytest.mark.parametrize("asked", CHOICES)
def test_the_fused_linear_cross_entropy_is_float64s_through_either_library(monkeypatch, asked):
    x, w, target = _float32_inputs(96, 3000, 64, 2)
    bias = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    _check_against_float64(
        asked, monkeypatch,
        lambda x, w, b: ts.nn.functional.parallel_linear_cross_entropy(x, w, b, target, chunk_size=1024),
        lambda x, w, b: cross_entropy_reference(torch.nn.functional.linear(x, w, b), target), [x, w, bias])


@pytest.mark.parametrize("asked", CHOICES)
@pytest.mark.parametrize("dim", [0, 1])
def test_the_parallel_linear_layer_is_float64s_through_either_library(monkeypatch, asked, dim):
    x, w, _ = _float32_inputs(200, 256, 128, 4)
    bias = torch.randn(256, generator=torch.Generator().manual_seed(5))
    upstream = torch.randn(200, 256, generator=torch.Generator().manual_seed(6))
    _check_against_float64(
        asked, monkeypatch,
        lambda x, w, b: (ts.nn.functional.parallel_linear(x, w, b, dim) * upstream).sum(),
        lambda x, w, b: (torch.nn.functional.linear(x, w, b) * upstream.double()).sum(), [x, w, bias])
