"""ts.nn.ParallelMarginLoss on CUDA against the CPU float64 result: class sampling, the
row-sparse weight gradient, both row-sparse optimizers and the loss under autocast; skipped
where no GPU is present.

The CUDA generator draws other classes than the CPU one, so each reference is computed in
float64 on the CPU over the kept classes the CUDA module drew (``last_sampled_classes``), after
the draw itself is checked (size, order, positives kept). The checks are written for any
device (``DEVICE``); SHARDTORCH_MARGIN_TEST_DEVICE=cpu runs them on the CPU, which is how they
were checked on a machine without a GPU.
"""
import math
import os

import pytest
import torch

import shardtorch as ts
from shardtorch import _C
from shardtorch.utils.host_syncs import host_syncs
from tests.reference import margin_cross_entropy_reference

DEVICE = os.environ.get("SHARDTORCH_MARGIN_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and (not torch.cuda.is_available() or not ts.cuda_built),
                                 reason="needs a CUDA device and shardtorch built with CUDA")]
ROWS, FEATURES, CLASSES = 48, 16, 3001
LAG = _C._DEFERRED_CHECK_LAG  # a deferred check is given at its group's LAG-th collective after its own


@pytest.fixture(autouse=True)
def _needs_the_world(request):
    request.getfixturevalue("cuda_world_of_one" if DEVICE == "cuda" else "world_of_one")
    yield


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, dtype=torch.float64, generator=g)
    target = torch.randint(0, CLASSES, (ROWS,), generator=g)
    target[::11] = -100
    return x, target


def _reference(module, x, target, kept):
    """(loss, input gradient, dense weight gradient) in float64 on the CPU over ``kept``."""
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = module.weight.detach().cpu().double().requires_grad_()
    kept = None if kept is None else kept.cpu()
    loss = margin_cross_entropy_reference(x64, w64, target.cpu(), module.scale, module.margins,
                                          module.easy_margin, label_smoothing=module.label_smoothing,
                                          kept_classes=kept)
    loss.backward()
    return loss.detach(), x64.grad, w64.grad


def _check_the_draw(module, target, rate):
    kept = module.last_sampled_classes
    assert kept.device.type == DEVICE and kept.dtype == torch.int64
    assert kept.numel() == math.ceil(rate * CLASSES)
    assert bool((kept[1:] > kept[:-1]).all()) and 0 <= int(kept[0]) and int(kept[-1]) < CLASSES
    positives = torch.unique(target[target >= 0]).to(kept.device)
    assert bool(torch.isin(positives, kept).all()), "a target class was not kept"


@pytest.mark.parametrize("rate", [0.2, 1.0])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_sampled_loss_and_row_sparse_gradient_match_float64_on_cpu(rate, dtype, tol):
    torch.manual_seed(3)
    module = ts.nn.ParallelMarginLoss(FEATURES, CLASSES, scale=32.0, margins=ts.nn.MARGIN_PRESETS["combined"],
                                      sample_rate=rate, label_smoothing=0.1, device=DEVICE, dtype=dtype,
                                      chunk_size=512)
    x, target = _batch(1)
    x_dev = x.to(DEVICE, dtype).requires_grad_()
    loss = module(x_dev, target.to(DEVICE))
    loss.backward()
    kept = module.last_sampled_classes if rate < 1.0 else None
    if rate < 1.0:
        _check_the_draw(module, target, rate)
    ref_loss, ref_x, ref_w = _reference(module, x_dev, target, kept)
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(x_dev.grad.double().cpu(), ref_x, rtol=tol, atol=tol)
    grad = module.weight.grad
    if rate < 1.0:
        assert grad.layout == torch.sparse_coo
        assert torch.equal(grad.coalesce().indices()[0].cpu(), kept.cpu())
        grad = grad.to_dense()
    torch.testing.assert_close(grad.double().cpu(), ref_w, rtol=tol, atol=tol)


def test_draws_differ_per_step_and_repeat_with_the_seed():
    def draws(seed):
        module = ts.nn.ParallelMarginLoss(FEATURES, CLASSES, sample_rate=0.1, device=DEVICE, seed=seed)
        x, target = _batch(2)
        out = []
        for _ in range(2):
            module(x.to(DEVICE, torch.float32), target.to(DEVICE))
            out.append(module.last_sampled_classes.cpu())
        return out

    first, second = draws(5), draws(5)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], first[1])


def _torch_step_on_rows(optimizer_class, weight64, grad64, kept, **options):
    """torch's own optimizer, one step on the kept rows only (the rule of the row-sparse ones)."""
    rows = weight64[kept].clone().requires_grad_()
    rows.grad = grad64[kept].clone()
    optimizer_class([rows], **options).step()
    out = weight64.clone()
    out[kept] = rows.detach()
    return out


@pytest.mark.parametrize("name,torch_class,options", [
    ("RowSparseSGD", torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}),
    ("RowSparseAdam", torch.optim.Adam, {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.01}),
])
def test_row_sparse_optimizers_move_the_kept_rows_as_torch_does(name, torch_class, options):
    torch.manual_seed(4)
    module = ts.nn.ParallelMarginLoss(FEATURES, CLASSES, scale=16.0, sample_rate=0.1, device=DEVICE,
                                      dtype=torch.float64)
    optimizer = getattr(ts.optim, name)(module.parameters(), **options)
    x, target = _batch(3)
    module(x.to(DEVICE), target.to(DEVICE)).backward()
    kept = module.last_sampled_classes.cpu()
    before = module.weight.detach().cpu().clone()
    _, _, ref_grad = _reference(module, x, target, kept)
    optimizer.step()
    expected = _torch_step_on_rows(torch_class, before, ref_grad, kept, **options)
    after = module.weight.detach().cpu()
    torch.testing.assert_close(after, expected, rtol=1e-10, atol=1e-12)
    not_kept = torch.ones(CLASSES, dtype=torch.bool)
    not_kept[kept] = False
    assert torch.equal(after[not_kept], before[not_kept]) and not torch.equal(after[kept], before[kept])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_under_autocast_the_loss_is_float32_and_the_gradient_row_sparse(weight_dtype):
    torch.manual_seed(6)
    module = ts.nn.ParallelMarginLoss(FEATURES, CLASSES, scale=16.0, sample_rate=0.5, device=DEVICE,
                                      dtype=weight_dtype, chunk_size=256)
    x, target = _batch(4)
    x_dev = x.to(DEVICE, torch.float32).requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = module(x_dev, target.to(DEVICE))
    assert loss.dtype == torch.float32
    loss.backward()
    kept = module.last_sampled_classes
    _check_the_draw(module, target, 0.5)
    # The op's GEMMs run in bfloat16 (u = 2^-8), the rest in float32: the loss within 3u * scale *
    # the margin's slope (< 2 here) of the float64 one, the gradients within 8u of their norm
    # (tests/ops/test_autocast.py); the reference is over the same input and (for a bfloat16 weight,
    # already rounded) weight.
    ref_loss, ref_x, ref_w = _reference(module, x_dev, target, kept)
    u = 2.0 ** -8
    assert abs(loss.item() - ref_loss.item()) <= 2 * 3 * u * 16.0
    assert (x_dev.grad.double().cpu() - ref_x).norm() <= 8 * u * ref_x.norm()
    grad = module.weight.grad
    assert grad.layout == torch.sparse_coo and grad.dtype == weight_dtype
    assert (grad.to_dense().double().cpu() - ref_w).norm() <= 8 * u * ref_w.norm()

@pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA host synchronisations")
@pytest.mark.parametrize("rate,most", [(0.1, 2), (1.0, 0)])
def test_host_syncs_per_step(rate, most):
    """At rate < 1 at most two host reads per step (docs/cuda.md): the count of the shard's
    positives and the count of distinct drawn classes, which set the kept count; none in the op
    itself (its check of the kept classes stays on the device and is given later, without a wait),
    none at rate 1."""
    module = ts.nn.ParallelMarginLoss(FEATURES, CLASSES, sample_rate=rate, device="cuda")
    x, target = _batch(5)
    x, target = x.to("cuda", torch.float32).requires_grad_(), target.cuda()
    module(x, target).backward()  # warm-up
    module.weight.grad = x.grad = None  # a sum of sparse gradients is not what is counted
    step = host_syncs(lambda: module(x, target).backward())
    module.weight.grad = x.grad = None
    assert len(step.debug_mode) <= most and step.deferred_check_waits == 0, step
    kept = module.last_sampled_classes
    op = host_syncs(lambda: ts.nn.functional.parallel_margin_cross_entropy(
        x, module.weight, target, sampled_classes=kept if rate < 1 else None).backward())
    assert not op.debug_mode and op.deferred_check_waits == 0, op


@pytest.mark.skipif(DEVICE != "cuda", reason="the deferred check is CUDA's")
def test_bad_sampled_classes_on_cuda_give_nan_then_a_clear_error():
    """Not read on the host: clamped for indexing (never a device fault), the loss NaN, and the
    group's 8th collective after the loss's raises, naming sampled_classes; the ones before go."""
    ts.distributed.check_deferred()  # nothing left from other tests
    w = torch.randn(50, FEATURES, device="cuda")
    x = torch.randn(4, FEATURES, device="cuda")
    target = torch.tensor([1, 2, 3, 4], device="cuda")
    bad = torch.tensor([1, 2, 3, 4, 60], device="cuda")  # 60 is out of range
    loss = ts.nn.functional.parallel_margin_cross_entropy(x, w, target, sampled_classes=bad)
    made_at = _C._deferred_check_counts("tp")["launches"]  # the loss's gather, its last collective
    assert torch.isnan(loss).item()
    while _C._deferred_check_counts("tp")["launches"] < made_at + LAG - 1:
        torch.ops.shard.reduce(torch.ones(2, device="cuda"), "tp")
    with pytest.raises(RuntimeError, match=r"sampled_classes must be strictly increasing local class indices"):
        torch.ops.shard.reduce(torch.ones(2, device="cuda"), "tp")
