"""The cross-entropy ops on CUDA (custom kernels, NCCL in a world-1 group)
against the float64 reference; skipped where no GPU is present."""
import pytest
import torch

import shardtorch as ts
from shardtorch import _C
from shardtorch.utils.host_syncs import host_syncs, profiled_host_syncs
from tests.reference import cross_entropy_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not ts.cuda_built,
                                 reason="needs a CUDA device and shardtorch built with CUDA")]
OPS = torch.ops.shard
LAG = _C._DEFERRED_CHECK_LAG  # a deferred check is given at its group's LAG-th collective after its own


@pytest.fixture(autouse=True)
def _needs_the_cuda_world(cuda_world_of_one):
    yield


TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted,smoothing,z_loss", [(False, 0.0, 0.0), (True, 0.1, 1e-2)])
def test_matches_reference(dtype, reduction, weighted, smoothing, z_loss):
    torch.manual_seed(0)
    rows, classes = 37, 1003  # more columns than threads per block, odd sizes
    full = (torch.randn(rows, classes, dtype=torch.float64) * 3).cuda()
    target = torch.randint(0, classes, (rows,)).cuda()
    target[::5] = -100
    weight = (torch.rand(classes, dtype=torch.float64) + 0.5).cuda() if weighted else None
    x = full.to(dtype).clone().requires_grad_()
    before = x.detach().clone()
    loss = ts.nn.functional.parallel_cross_entropy(
        x, target, None if weight is None else weight.to(dtype), -100, reduction, smoothing,
        z_loss, parallel=True)
    x_ref = full.to(dtype).double().requires_grad_()
    ref = cross_entropy_reference(x_ref, target, weight, -100, reduction, smoothing, z_loss)
    upstream = torch.randn_like(ref)
    (loss.double() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    assert torch.equal(x.detach(), before)
    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_matches_linear_then_loss(dtype):
    torch.manual_seed(1)
    x = torch.randn(33, 16, dtype=dtype, device="cuda")
    w = torch.randn(2001, 16, dtype=dtype, device="cuda")
    b = torch.randn(2001, dtype=dtype, device="cuda")
    target = torch.randint(0, 2001, (33,), device="cuda")
    grads = []
    for fused in (False, True):
        args = [t.clone().requires_grad_() for t in (x, w, b)]
        if fused:
            loss = ts.nn.functional.parallel_linear_cross_entropy(*args, target, chunk_size=512,
                                                                  label_smoothing=0.1)
        else:
            loss = ts.nn.functional.parallel_cross_entropy(
                torch.nn.functional.linear(*args), target, label_smoothing=0.1, parallel=True)
        loss.backward()
        grads.append([loss.detach()] + [a.grad for a in args])
    tol = TOL[dtype] * 10
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, rtol=tol, atol=tol)


@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
def test_autocast_runs_in_float32(amp_dtype):
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 301).cuda()
    x = torch.randn(8, 16, device="cuda")
    target = torch.randint(0, 301, (8,), device="cuda")
    reference = ts.nn.functional.parallel_cross_entropy(head(x), target, parallel=True)
    with torch.autocast("cuda", dtype=amp_dtype):
        loss = ts.nn.functional.parallel_cross_entropy(head(x), target, parallel=True)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=2e-2, atol=2e-2)
    scaler = torch.amp.GradScaler("cuda")
    scaler.scale(loss).backward()
    assert torch.isfinite(head.weight.grad).all()


def _tp_launches():
    return _C._deferred_check_counts("tp")["launches"]


def test_out_of_range_target_raises_at_the_lagth_collective_after_the_loss():
    """No host read in the forward: the bad target makes this loss NaN (never a plausible number),
    the group's next LAG - 1 collectives go, and the LAG-th raises, naming it (docs/cuda.md)."""
    ts.distributed.check_deferred()  # nothing left from other tests
    logits = torch.randn(3, 5, device="cuda")
    loss = OPS.parallel_cross_entropy(logits, torch.tensor([0, 5, 1], device="cuda"))
    made_at = _tp_launches()  # the loss's gather
    assert torch.isnan(loss).item()
    ones = torch.ones(2, device="cuda")
    while _tp_launches() < made_at + LAG - 1:
        OPS.reduce(ones, "tp")
    with pytest.raises(RuntimeError, match=r"target values must be in \[0, num_classes=5\).*got 5"):
        OPS.reduce(ones, "tp")
    # Raised once: the group works again.
    torch.testing.assert_close(OPS.reduce(ones, "tp"), ones)


def test_check_deferred_raises_the_pending_verdict_now():
    ts.distributed.check_deferred()
    OPS.parallel_cross_entropy(torch.randn(3, 5, device="cuda"), torch.tensor([0, 1, -7], device="cuda"))
    with pytest.raises(RuntimeError, match=r"target values must be in \[0, num_classes=5\).*got -7"):
        ts.distributed.check_deferred()
    ts.distributed.check_deferred()  # given once


@pytest.mark.tooling
def test_the_host_runs_lag_collectives_ahead_of_a_busy_gpu_without_waiting():
    """While the GPU is busy (a long sleep kernel ahead of the loss), the host launches the loss
    and LAG - 1 more collectives without one wait: no cudaEventSynchronize (the profiler), no wait
    counted by the communicator, nothing for sync_debug_mode. The verdict, a bad target, still comes
    at the LAG-th, which waits for the copy if the GPU is still behind."""
    logits, bad = torch.randn(3, 5, device="cuda"), torch.tensor([0, 5, 1], device="cuda")
    ones = torch.ones(2, device="cuda")
    # Warm-up, not measured: the communicator, pinned host memory for the checks, the sleep kernel.
    OPS.parallel_cross_entropy(logits, torch.tensor([0, 1, 2], device="cuda"))
    OPS.reduce(ones, "tp")
    torch.cuda._sleep(1000)
    ts.distributed.check_deferred()
    seen = {}

    def run_ahead():
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time: every copy after it waits
        OPS.parallel_cross_entropy(logits, bad)
        seen["made_at"] = _tp_launches()
        for _ in range(LAG - 1):
            OPS.reduce(ones, "tp")
        seen["counts"] = dict(_C._deferred_check_counts("tp"))

    before = _C._deferred_check_counts("tp")
    profiled = profiled_host_syncs(run_ahead)
    assert profiled.sync_calls == 0, profiled  # the old rule waited for the copy at the first reduce
    assert seen["counts"]["waits"] == before["waits"] and seen["counts"]["pending"] >= 1, seen
    with pytest.raises(RuntimeError, match=r"target values must be in \[0, num_classes=5\).*got 5"):
        OPS.reduce(ones, "tp")

    counted = host_syncs(run_ahead)
    assert not counted.debug_mode and counted.deferred_check_waits == 0, counted
    with pytest.raises(RuntimeError, match=r"target values must be in \[0, num_classes=5\).*got 5"):
        OPS.reduce(ones, "tp")  # due: it waits for the copy behind the sleep, if still there
    after = _C._deferred_check_counts("tp")
    assert after["waits"] - seen["counts"]["waits"] <= 1 and after["pending"] == 0, (seen, after)


@pytest.mark.tooling
def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    logits = torch.randn(6, 300, device="cuda", dtype=torch.float64)
    target = torch.randint(0, 300, (6,), device="cuda")

    def fn(x):
        return OPS.parallel_cross_entropy(x, target, None, -100, 0.1, 1e-3, 1, "tp")

    outs = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        x = logits.clone().requires_grad_()
        y = f(x)
        y.backward()
        outs.append((y.detach(), x.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("num_classes", [301, None])
def test_losses_never_synchronise_with_the_host(fused, num_classes):
    """Out-of-range targets and every rank's check results travel in the one
    gathered buffer, read on the host without waiting for the device; without
    num_classes the shard sizes travel over the group's CPU backend: neither
    forward nor backward synchronises."""
    torch.manual_seed(2)
    x = torch.randn(16, 8, device="cuda", requires_grad=True)
    w = torch.randn(301, 8, device="cuda", requires_grad=True)
    target = torch.randint(0, 301, (16,), device="cuda")
    class_weight = torch.rand(301, device="cuda") + 0.5  # full size: sliced on the device
    out = {}

    def forward():
        if fused:
            out["loss"] = ts.nn.functional.parallel_linear_cross_entropy(
                x, w, None, target, class_weight, num_classes=num_classes)
        else:
            out["loss"] = ts.nn.functional.parallel_cross_entropy(
                x @ w.t(), target, class_weight, parallel=True, num_classes=num_classes)

    forward_syncs = host_syncs(forward)
    backward_syncs = host_syncs(lambda: out["loss"].backward())
    # Nor does the host wait for the deferred checks' copies (which sync_debug_mode cannot see).
    for syncs in (forward_syncs, backward_syncs):
        assert not syncs.debug_mode and syncs.deferred_check_waits == 0, (forward_syncs, backward_syncs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows,classes,reduction", [
    (33, 2001, "mean"),     # one block of rows
    (400, 16000, "sum"),    # two blocks of rows
    (160, 70000, "mean"),   # blocks too thin: the logits computed twice in forward
])
def test_fused_gradients_in_forward_match_reference(dtype, rows, classes, reduction):
    g = torch.Generator().manual_seed(classes)
    x = torch.randn(rows, 16, dtype=torch.float64, generator=g)
    w = torch.randn(classes, 16, dtype=torch.float64, generator=g) * 0.5
    b = torch.randn(classes, dtype=torch.float64, generator=g)
    weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5
    target = torch.randint(0, classes, (rows,), generator=g)
    target[::7] = -100
    kwargs = dict(ignore_index=-100, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    ref_args = [t.cuda().requires_grad_() for t in (x, w, b)]
    ref = cross_entropy_reference(torch.nn.functional.linear(*ref_args), target.cuda(),
                                  weight.cuda(), **kwargs)
    (3.0 * ref).backward()
    args = [t.to("cuda", dtype).requires_grad_() for t in (x, w, b)]
    loss = ts.nn.functional.parallel_linear_cross_entropy(*args, target.cuda(),
                                                          weight.to("cuda", dtype), **kwargs)
    (3.0 * loss).backward()
    tol = TOL[dtype] * 10
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    for mine, theirs in zip(args, ref_args):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=tol, atol=tol)
