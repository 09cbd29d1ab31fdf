"""How many GEMMs the fused heads do when they compute their gradients in forward, and what memory
the blocks of rows take: a block of logits holds max(rows x chunk_size, 2**22) values, or, where blocks
that size would be thinner than 128 rows, as many as the largest weight shard has, so wherever the
weight has at least 128 features a block of at least 128 rows holds every column and the logits are
computed once: three GEMMs per row (logits, input gradient, weight gradient) at any class count. Below
that (few features, many classes) they are computed twice.
The GEMMs are counted from the profiler's shapes, the results checked against float64 references."""
import math

import pytest
import torch

import shardtorch as ts
from tests.ops.test_cross_entropy_ops import _peak_bytes_of
from tests.reference import cross_entropy_reference, margin_cross_entropy_reference

GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_")
ROWS, CLASSES, CHUNK = 256, 40000, 1024
ARCFACE = (1.0, 0.5, 0.0)


def _gemm_flops(step):
    """Runs ``step`` under the profiler: its result and the multiply-adds of every ATen GEMM it ran
    (2 m k n each, from the two factors' shapes: mm's first two operands, addmm's second and third)."""
    from torch.profiler import profile
    with profile(record_shapes=True) as prof:
        out = step()
    flops = 0
    for e in prof.profiler.kineto_results.events():
        if e.name() in GEMMS:
            shapes = e.shapes()
            (m, k), (_, n) = shapes[:2] if e.name() == "aten::mm" else shapes[1:3]
            flops += 2 * m * k * n
    return out, flops


def _case(head, features):
    g = torch.Generator().manual_seed(features)
    x = torch.randn(ROWS, features, dtype=torch.float64, generator=g)
    w = torch.randn(CLASSES, features, dtype=torch.float64, generator=g) / features ** 0.5
    target = torch.randint(0, CLASSES, (ROWS,), generator=g)
    kept = None
    if head == "margin_sampled":  # a third of the classes kept, every target among them
        kept = torch.unique(torch.cat([target, torch.randperm(CLASSES, generator=g)[: CLASSES // 3]]))
    return x, w, target, kept


def _loss_and_backward(head, xs, ws, target, kept):
    if head == "linear":
        loss = ts.nn.functional.parallel_linear_cross_entropy(xs, ws, None, target, label_smoothing=0.1,
                                                              chunk_size=CHUNK)
    else:
        loss = ts.nn.functional.parallel_margin_cross_entropy(xs, ws, target, 16.0, ARCFACE, sampled_classes=kept,
                                                              label_smoothing=0.1, chunk_size=CHUNK)
    loss.backward()
    return loss.detach()


def _ours(head, x, w, target, kept):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    return _loss_and_backward(head, xs, ws, target, kept), xs.grad, ws.grad


def _reference(head, x, w, target, kept):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    if head == "linear":
        ref = cross_entropy_reference(xr @ wr.t(), target, None, -100, "mean", 0.1)
    else:
        ref = margin_cross_entropy_reference(xr, wr, target, 16.0, ARCFACE, label_smoothing=0.1,
                                             kept_classes=kept)
    ref.backward()
    return ref.detach(), xr.grad, wr.grad


@pytest.mark.parametrize("head,features,products", [
    # 2**22 // 40000 = 104 rows, but the weight's 40000 x 128 values hold blocks of 128 rows
    ("linear", 128, 3), ("margin", 128, 3), ("margin_sampled", 128, 3),
    # the weight's 40000 x 64 values are below 2**22: blocks of 104 rows would be too thin
    ("linear", 64, 4), ("margin", 64, 4),
    # 13501 classes kept: 2**22 // 13501 = 310 rows, one block
    ("margin_sampled", 64, 3),
])
def test_the_logits_are_computed_once_where_a_block_fits_the_weights_size(world_of_one, head, features,
                                                                          products):
    x, w, target, kept = _case(head, features)
    columns = CLASSES if kept is None else kept.numel()
    (loss, gx, gw), flops = _gemm_flops(lambda: _ours(head, x, w, target, kept))
    assert flops == products * 2 * ROWS * columns * features, (flops / (2 * ROWS * columns * features))
    ref, rx, rw = _reference(head, x, w, target, kept)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx, rx, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw.to_dense() if gw.is_sparse else gw, rw, rtol=1e-9, atol=1e-12)


def _exp_elements(step):
    """Runs ``step`` under the profiler: how many values its ATen exps took."""
    from torch.profiler import profile
    with profile(record_shapes=True) as prof:
        step()
    return sum(math.prod(e.shapes()[0]) for e in prof.profiler.kineto_results.events()
               if e.name() in ("aten::exp", "aten::exp_"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "bfloat16 autocast"])
@pytest.mark.parametrize("head,features,passes", [
    ("linear", 128, 1), ("margin", 128, 1), ("margin_sampled", 64, 1),
    ("linear", 64, 2),  # blocks too thin: the logits, and so their exps, are computed twice
])
def test_a_block_of_all_columns_takes_one_exp_per_logit(world_of_one, head, features, passes, dtype):
    """Where a block of rows holds every column, its statistics' pass leaves each logit as its exp(x -
    row max) and the gradient's pass scales that by exp(row max - lse): one exp per logit, not one per
    pass. Beside them only per-row exps. The results against float64 are the test above's."""
    x, w, target, kept = _case(head, features)
    columns = CLASSES if kept is None else kept.numel()
    autocast = dtype == "bfloat16 autocast"
    if not autocast:
        x, w = x.to(dtype), w.to(dtype)
    xs, ws = x.float().requires_grad_() if autocast else x.requires_grad_(), w.float() if autocast else w
    ws.requires_grad_()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return _loss_and_backward(head, xs, ws, target, kept)

    exps = _exp_elements(step)
    per_row = 4 * math.ceil(columns / CHUNK)  # at most a few per row and chunk of columns
    assert passes * ROWS * columns <= exps <= (passes * columns + per_row) * ROWS, exps / (ROWS * columns)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("head", ["linear", "margin"])
def test_a_block_of_all_columns_takes_at_most_the_weight_gradients_size(world_of_one, head, autocast):
    """Beyond the weight gradient it returns, the loss holds one block of logits, at most the size of
    the weight shard (here 2 blocks of 128 rows x 40000 classes = the 40000 x 128 weight), plus a
    chunk's temporaries: the CPU row passes' (2**18 values) and a chunk of weight rows. Under bfloat16
    autocast (a float32 weight) no copy of the weight or of the block in bfloat16 is kept: the GEMMs'
    operands are cast a chunk of columns at a time."""
    x, w, target, kept = _case(head, 128)
    if autocast:
        x, w = x.float(), w.float()
    xs, ws = x.requires_grad_(), w.requires_grad_()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return _loss_and_backward(head, xs, ws, target, kept)

    step()  # warm up lazily allocated state
    xs.grad = ws.grad = None
    weight_bytes = w.numel() * w.element_size()
    extra = _peak_bytes_of(step) - weight_bytes
    block_bytes = 128 * CLASSES * w.element_size()
    assert block_bytes <= extra <= weight_bytes + 4 * CHUNK * 128 * w.element_size() + (1 << 18) * 8, extra


@pytest.mark.parametrize("head", ["linear", "margin"])
def test_blocks_the_lean_bound_already_allows_are_not_enlarged(world_of_one, head):
    """Where max(rows x chunk_size, 2**22) already holds blocks of 128 rows (a language model's head:
    many rows), the blocks stay within it: 512 rows x 20000 classes go in 3 blocks of 171 rows (2**22 //
    20000 = 209), not in blocks as large as the 20000 x 256 weight (2 of 256 rows, 25% more memory)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=g).requires_grad_()
    w = (torch.randn(20000, 256, generator=g) / 16).requires_grad_()
    target = torch.randint(0, 20000, (512,), generator=g)
    _loss_and_backward(head, x, w, target, None)
    x.grad = w.grad = None
    extra = _peak_bytes_of(lambda: _loss_and_backward(head, x, w, target, None)) - w.numel() * 4
    # The block, a chunk's temporaries (the CPU row passes' 2**18 values; a chunk of weight rows and
    # of logits in the margin head), and below the weight-sized block.
    assert 171 * 20000 * 4 <= extra <= 171 * 20000 * 4 + (3 << 20) < 256 * 20000 * 4, extra


def test_sampled_margin_gathers_the_kept_rows_once(world_of_one):
    """With sampling the margin head gathers the kept rows once per call (a copy as large as the
    row-sparse gradient it returns) and makes its logits, both gradients and the normalisation's
    derivative from it: beyond that gradient the loss holds the gathered rows and one block, here the
    13501 kept rows x 128 features and 256 rows x 13501 classes (2**22 holds them: one block)."""
    x, w, target, kept = _case("margin_sampled", 128)
    xs, ws = x.requires_grad_(), w.requires_grad_()
    _loss_and_backward("margin_sampled", xs, ws, target, kept)
    xs.grad = ws.grad = None
    gradient_bytes = kept.numel() * (128 * w.element_size() + 8)  # values and row indices
    extra = _peak_bytes_of(lambda: _loss_and_backward("margin_sampled", xs, ws, target, kept)) - gradient_bytes
    gathered, block = kept.numel() * 128 * w.element_size(), ROWS * kept.numel() * w.element_size()
    assert gathered + block <= extra <= gathered + block + (3 << 20), (extra, gathered, block)
    # The kept rows gathered once: the profiler sees one gather of all of them (on the CPU in float32 the
    # head's own, which normalises them in the same pass; else index_select).
    from torch.profiler import profile
    with profile(record_shapes=True) as prof:
        _loss_and_backward("margin_sampled", xs, ws, target, kept)
    names = ("aten::index_select", "shard::gather_scaled_unit_rows")
    gathers = [(e.name(), e.shapes()[-1]) for e in prof.profiler.kineto_results.events() if e.name() in names
               and len(e.shapes()[0]) == 2 and e.shapes()[0][0] == CLASSES]
    assert gathers == [("shard::gather_scaled_unit_rows", [kept.numel()])], gathers

