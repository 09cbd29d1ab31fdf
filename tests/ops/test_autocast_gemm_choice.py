"""Which dtype the fused heads' CPU GEMMs run in under autocast: the autocast dtype where this CPU
multiplies it in hardware (Linux's cpuinfo flags amx_bf16 / avx512_bf16 for bfloat16, amx_fp16 /
avx512_fp16 for float16), float32 elsewhere (an emulated bfloat16 GEMM is a float32 one done slower),
and what SHARDTORCH_CPU_AUTOCAST_GEMMS asks for. The suite sets it to ``reduced`` (conftest.py); these
tests set it themselves."""
import platform

import pytest
import torch

import shardtorch as ts
from tests.ops.test_autocast import GEMMS

NATIVE_FLAGS = {torch.bfloat16: {"amx_bf16", "avx512_bf16"}, torch.float16: {"amx_fp16", "avx512_fp16"}}


def _cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _native(dtype):
    if platform.machine() not in ("x86_64", "AMD64"):
        return True  # taken as they come off x86
    return bool(_cpu_flags() & NATIVE_FLAGS[dtype])


def _margin_step(x, w, target, dtype, amp):
    """Loss, gradients and the operand dtypes of every ATen GEMM the step ran."""
    from torch.profiler import profile
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with profile(record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=dtype, enabled=amp):
            loss = ts.nn.functional.parallel_margin_cross_entropy(xs, ws, target, 16.0, (1.0, 0.5, 0.0))
        loss.backward()
    gemms = {e.dtypes()[0] for e in prof.profiler.kineto_results.events() if e.name() in GEMMS}
    return (loss.detach(), xs.grad, ws.grad), gemms


def _linear_step(x, w, target, dtype, amp):
    from torch.profiler import profile
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with profile(record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=dtype, enabled=amp):
            loss = ts.nn.functional.parallel_linear_cross_entropy(xs, ws, None, target)
        loss.backward()
    gemms = {e.dtypes()[0] for e in prof.profiler.kineto_results.events() if e.name() in GEMMS}
    return (loss.detach(), xs.grad, ws.grad), gemms


def _inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 32, generator=g)
    w = torch.randn(300, 32, generator=g)
    return x, w, torch.randint(0, 300, (24,), generator=g)


@pytest.mark.parametrize("step", [_margin_step, _linear_step])
@pytest.mark.parametrize("asked", [None, "auto", "reduced", "float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_gemm_dtype_under_autocast(world_of_one, monkeypatch, dtype, asked, step):
    if asked is None:
        monkeypatch.delenv("SHARDTORCH_CPU_AUTOCAST_GEMMS", raising=False)
    else:
        monkeypatch.setenv("SHARDTORCH_CPU_AUTOCAST_GEMMS", asked)
    reduced = asked == "reduced" or (asked in (None, "auto") and _native(dtype))
    x, w, target = _inputs()
    got, gemms = step(x, w, target, dtype, True)
    want, float32_gemms = step(x, w, target, dtype, False)
    assert float32_gemms == {"float"}
    if reduced:
        assert gemms == {{torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}[dtype]}
        # the reduced precision's rounding shows in the gradients
        assert not torch.equal(got[2], want[2])
    else:
        # float32 GEMMs: the step is the float32 op's, bit for bit
        assert gemms == {"float"}
        for a, b in zip(got, want):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_an_unknown_choice_is_refused(world_of_one, monkeypatch):
    monkeypatch.setenv("SHARDTORCH_CPU_AUTOCAST_GEMMS", "bf16")
    x, w, target = _inputs()
    with pytest.raises(RuntimeError, match="SHARDTORCH_CPU_AUTOCAST_GEMMS must be auto, reduced or float32"):
        _margin_step(x, w, target, torch.bfloat16, True)
