"""Probability (soft) targets of the parallel cross-entropy on CUDA (the CUDA
kernels take the target's sums in their forward row pass and its term in
their backward pass, NCCL in a world-1 group) against F.cross_entropy or a
plain float64 formula; skipped where no GPU is present. The CPU twins are in
tests/ops/test_probability_targets.py and test_fused_probability_targets.py."""
import pytest
import torch

import shardtorch as ts
from tests.ops.test_fused_probability_targets import _confident_head
from tests.ops.test_probability_targets import _confident, _plain_float64_loss_and_grad
from tests.reference import probability_cross_entropy_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not ts.cuda_built,
                                 reason="needs a CUDA device and shardtorch built with CUDA")]

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _needs_the_cuda_world(cuda_world_of_one):
    yield


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("weighted,smoothing,z_loss", [(False, 0.0, 0.0), (True, 0.1, 1e-2)])
def test_matches_torch(dtype, reduction, weighted, smoothing, z_loss):
    torch.manual_seed(0)
    rows, classes = 37, 1003
    full = (torch.randn(rows, classes, dtype=torch.float64) * 3).cuda()
    probs = torch.randn(rows, classes, dtype=torch.float64).mul(2).softmax(-1).cuda()
    weight = (torch.rand(classes, dtype=torch.float64) + 0.5).cuda() if weighted else None
    target = probs.to(dtype) if dtype != torch.bfloat16 else probs.float()
    x = full.to(dtype).clone().requires_grad_()
    loss = ts.nn.functional.parallel_cross_entropy(x, target, None if weight is None else weight.to(dtype), -100,
                                                   reduction, smoothing, z_loss, parallel=True)
    x_ref = full.to(dtype).double().requires_grad_()
    ref = probability_cross_entropy_reference(x_ref, target.double(), weight, reduction, smoothing, z_loss)
    upstream = torch.randn_like(ref)
    (loss.double() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=tol, atol=tol / 100)


def test_a_million_local_classes():
    """130 rows of a million classes: each row split over many blocks of the row kernels, whose
    partial sums of the target merge in a second kernel."""
    torch.manual_seed(1)
    rows, classes = 130, 1 << 20
    full = torch.randn(rows, classes, device="cuda") * 3
    probs = torch.randn(rows, classes, device="cuda").softmax(-1)
    x = full.clone().requires_grad_()
    loss = ts.nn.functional.parallel_cross_entropy(x, probs, None, -100, "mean", 0.1, 0.0, parallel=True)
    x_ref = full.double().requires_grad_()
    ref = probability_cross_entropy_reference(x_ref, probs.double(), None, "mean", 0.1, 0.0)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    assert ((x.grad.double() - x_ref.grad).norm() / x_ref.grad.norm()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("classes", [3000, 1 << 20])
def test_large_confident_logits_do_not_cancel(dtype, weighted, classes):
    """The CPU test's case (logits near 1000, the target on each row's top class) on the CUDA
    kernels: B summed relative to each thread's, warp's, block's and row's max and rebased as
    they merge; at a million classes a row spans many blocks."""
    rows = 16 if classes == 3000 else 4
    logits, probs = _confident(rows=rows, classes=classes, dtype=dtype, seed=11)
    weight = (torch.rand(classes, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype) if weighted else None
    x = logits.cuda().requires_grad_()
    loss = ts.nn.functional.parallel_cross_entropy(x, probs.cuda(), None if weight is None else weight.cuda(),
                                                   -100, "none", 0.0, 0.0, parallel=True)
    loss.sum().backward()
    ref, ref_grad = _plain_float64_loss_and_grad(logits, probs, weight)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(loss.double().cpu(), ref, rtol=1e-4 if dtype == torch.float32 else eps / 2, atol=0)
    w_max = 1.0 if weight is None else weight.double().max().item()
    f32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(x.grad.double().cpu(), ref_grad, rtol=eps / 2, atol=4 * f32 * w_max)


@pytest.mark.parametrize("logits_dtype,target_dtype", [
    (torch.float64, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_target_in_another_dtype_and_layout(logits_dtype, target_dtype):
    """The kernels read the target in its own dtype (the logits' or float32), and a target whose
    columns are not adjacent (a transposed view) through a copy."""
    torch.manual_seed(2)
    rows, classes = 33, 517
    full = torch.randn(rows, classes, dtype=torch.float64) * 3
    probs = torch.randn(rows, classes, dtype=torch.float64).softmax(-1).to(target_dtype)
    for target in (probs.cuda(), probs.t().contiguous().cuda().t()):
        x = full.to(logits_dtype).cuda().requires_grad_()
        loss = ts.nn.functional.parallel_cross_entropy(x, target, None, -100, "sum", 0.1, 0.0, parallel=True)
        loss.backward()
        x_ref = full.to(logits_dtype).double().requires_grad_()
        ref = probability_cross_entropy_reference(x_ref, probs.double(), None, "sum", 0.1, 0.0)
        ref.backward()
        tol = {torch.float64: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[logits_dtype]
        torch.testing.assert_close(loss.double().cpu(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad.double().cpu(), x_ref.grad, rtol=tol, atol=tol / 100)


@pytest.mark.parametrize("reduction,chunk", [("sum", 4096), ("none", 512)])
def test_fused_head_large_confident_logits(reduction, chunk):
    """The fused head's CPU test on CUDA: one block with gradients in forward ('sum'), and chunks
    whose max grows from chunk to chunk ('none', then the separate backward)."""
    x, W, b, probs = _confident_head(rows=64, classes=3000)
    xs, Ws, bs = (t.float().cuda().requires_grad_() for t in (x, W, b))
    loss = ts.nn.functional.parallel_linear_cross_entropy(xs, Ws, bs, probs.float().cuda(), None,
                                                          reduction=reduction, chunk_size=chunk)
    loss.sum().backward()
    z = (x @ W.t() + b).requires_grad_()
    row_loss = -(probs.float().double() * (z - torch.logsumexp(z, -1, keepdim=True))).sum(-1)
    ref = row_loss.sum() if reduction == "sum" else row_loss
    ref.sum().backward()
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=1e-4, atol=0)
    f32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(bs.grad.double().cpu(), z.grad.sum(0), rtol=0, atol=4 * f32 * 64)
