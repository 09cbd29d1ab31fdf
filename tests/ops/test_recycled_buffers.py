"""The fused heads' large CPU buffers kept for their next call (csrc/ops/recycled_buffers.h): taken
again only when nothing holds them, so a gradient the caller kept, or a view of it, is never written;
every step's results still those of the float64 references; kept buffers visible to the allocator
tracking and freed by free_recycled_buffers(); SHARDTORCH_RECYCLE_BUFFERS=0 keeps none."""
import os
import subprocess
import sys

import pytest
import torch

import shardtorch as ts
from shardtorch.utils.memory import free_recycled_buffers, track_cpu_memory
from tests.ops.test_fused_head_blocks import _case, _loss_and_backward, _reference

HEADS = ["linear", "margin", "margin_sampled"]
FEATURES = 64  # the weight gradient: 40000 x 64 float64 (20 MB), 13501 x 64 when sampled (7 MB)


def _inputs(head, seed):
    """Step `seed`'s rows and targets for the same weight (and kept classes)."""
    x, w, target, kept = _case(head, FEATURES)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(x.shape, dtype=x.dtype, generator=g)
    if kept is not None:  # targets among the kept classes
        target = kept[torch.randint(0, kept.numel(), target.shape, generator=g)]
    else:
        target = torch.randint(0, w.size(0), target.shape, generator=g)
    return x, w, target, kept


def _dense(grad):
    return grad.to_dense() if grad.is_sparse else grad


def _check_step(head, ws, seed):
    """One step on the shared weight `ws` (its .grad None before); its results against float64."""
    x, w, target, kept = _inputs(head, seed)
    xs = x.clone().requires_grad_()
    loss = _loss_and_backward(head, xs, ws, target, kept)
    ref, rx, rw = _reference(head, x, w, target, kept)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xs.grad, rx, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(_dense(ws.grad), rw, rtol=1e-9, atol=1e-12)
    return rw


@pytest.mark.parametrize("head", HEADS)
def test_a_gradient_the_caller_holds_is_never_written(world_of_one, head):
    _, w, _, _ = _inputs(head, 0)
    ws = w.clone().requires_grad_()
    _check_step(head, ws, 0)
    held = ws.grad  # the whole gradient kept (for logging, say)
    held_before = _dense(held).clone()
    ws.grad = None
    _check_step(head, ws, 1)
    torch.testing.assert_close(_dense(held), held_before, rtol=0, atol=0)
    # Only a view of the gradient's values held: their storage is still held.
    values = held._values() if held.is_sparse else held
    view = values[3:7]
    view_before = view.clone()
    del held, values
    ws.grad = None
    _check_step(head, ws, 2)
    ws.grad = None
    _check_step(head, ws, 3)
    torch.testing.assert_close(view, view_before, rtol=0, atol=0)


@pytest.mark.parametrize("head", HEADS)
def test_gradients_accumulated_over_steps_are_their_sum(world_of_one, head):
    """Without zeroing between backward passes autograd adds each step's gradient to the one it holds;
    the sum is that of the references (no step wrote into the gradient being accumulated)."""
    _, w, _, _ = _inputs(head, 0)
    ws = w.clone().requires_grad_()
    total = torch.zeros_like(w)
    for seed in range(3):
        x, _, target, kept = _inputs(head, seed)
        _loss_and_backward(head, x.clone().requires_grad_(), ws, target, kept)
        total += _reference(head, x, w, target, kept)[2]
    torch.testing.assert_close(_dense(ws.grad), total, rtol=1e-9, atol=1e-12)


def _step_peak_bytes(head, ws, seed):
    """Tensor bytes allocated at the highest point of one step beyond those alive before (the
    allocator tracking, without freeing the kept buffers first as PeakMemory does)."""
    from shardtorch import _C
    _C.reset_cpu_peak_memory()
    start = _C.cpu_memory_stats()[0]
    _check_step(head, ws, seed)
    return _C.cpu_memory_stats()[1] - start


@pytest.mark.parametrize("head", HEADS)
def test_a_released_gradient_is_taken_again_and_can_be_freed(world_of_one, head):
    track_cpu_memory()
    _, w, _, kept = _inputs(head, 0)
    ws = w.clone().requires_grad_()
    gradient_bytes = (w.size(0) if kept is None else kept.numel()) * FEATURES * w.element_size()
    free_recycled_buffers()
    cold = _step_peak_bytes(head, ws, 0)
    ws.grad = None
    warm = _step_peak_bytes(head, ws, 1)  # the last step's buffers taken again: nothing that large made
    assert warm <= cold - gradient_bytes, (warm, cold, gradient_bytes)
    ws.grad = None
    # Held by the head's call sites, and nobody else: freed now (the tracked bytes drop by as much).
    from shardtorch import _C
    before = _C.cpu_memory_stats()[0]
    freed = free_recycled_buffers()
    assert freed >= gradient_bytes and _C.cpu_memory_stats()[0] == before - freed, (freed, gradient_bytes)
    assert free_recycled_buffers() == 0
    # The gradient a caller holds is not freed (nor counted): the step's other buffers are.
    _check_step(head, ws, 2)
    assert free_recycled_buffers() <= freed - gradient_bytes


_OFF = """
import torch, torch.distributed as dist, shardtorch as ts
from shardtorch.utils.memory import free_recycled_buffers
dist.init_process_group("gloo", store=dist.FileStore("{store}", 1), rank=0, world_size=1)
ts.distributed.init_process_group(group_size=1)
w = torch.randn(40000, 64, requires_grad=True)
x, target = torch.randn(256, 64), torch.randint(0, 40000, (256,))
ts.nn.functional.parallel_linear_cross_entropy(x, w, None, target).backward()
w.grad = None
print(free_recycled_buffers())
"""


@pytest.mark.parametrize("setting,keeps", [("0", False), ("1", True)])
def test_recycling_can_be_turned_off(tmp_path, setting, keeps):
    env = dict(os.environ, SHARDTORCH_RECYCLE_BUFFERS=setting)
    code = _OFF.format(store=tmp_path / "store")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    freed = int(out.stdout.split()[-1])
    assert (freed >= 40000 * 64 * 4) if keeps else freed == 0, freed
