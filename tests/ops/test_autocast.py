"""shard::parallel_linear inside torch.autocast casts like aten::linear."""
import pytest
import torch
import torch.nn.functional as F

import shardtorch as ts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [None, 0, 1])
def test_parallel_linear_follows_autocast_like_linear(dim, dtype):
    torch.manual_seed(0)
    layer = ts.nn.ParallelLinear(8, 5, dim=dim)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        expected = F.linear(x, layer.weight, layer.bias)
        actual = layer(torch.tanh(x))  # tanh stays float32: the op casts its own input
        actual_plain = layer(x)
    assert actual.dtype == expected.dtype == dtype
    assert torch.equal(actual_plain, expected)
    actual_plain.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_float64_is_left_alone_under_autocast():
    layer = ts.nn.ParallelLinear(4, 3, dim=1, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 4, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_no_autocast_no_cast():
    layer = ts.nn.ParallelLinear(4, 3, dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert layer(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_loss_with_a_reduced_precision_weight(world_of_one, dtype):
    """What autocast on CUDA passes the fused loss (a float32 input, the weight
    and bias in the autocast dtype): GEMMs in the weight's dtype, loss and input
    gradient float32, weight gradients in the weight's dtype, all matching the
    float64 loss of the rounded operands. Runs here on CPU's ATen GEMMs."""
    from tests.reference import cross_entropy_reference
    torch.manual_seed(4)
    x = torch.randn(12, 16, requires_grad=True)
    w = (torch.randn(37, 16) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(37).to(dtype).requires_grad_()
    target = torch.randint(0, 37, (12,))
    loss = ts.nn.functional.parallel_linear_cross_entropy(x, w, b, target, chunk_size=10,
                                                          label_smoothing=0.1)
    assert loss.dtype == torch.float32
    loss.backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == dtype and b.grad.dtype == dtype
    x64 = x.detach().to(dtype).double().requires_grad_()
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = cross_entropy_reference(F.linear(x64, w64, b64), target, None, -100, "mean", 0.1)
    ref.backward()
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=tol, atol=tol)


def test_fused_loss_refuses_other_dtype_mixes(world_of_one):
    x = torch.randn(2, 4, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="input and weight must have the same dtype"):
        ts.nn.functional.parallel_linear_cross_entropy(x, w, None, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="weight and bias must have the same dtype"):
        ts.nn.functional.parallel_linear_cross_entropy(
            torch.randn(2, 4), w, torch.randn(3), torch.tensor([0, 1]))



# Under autocast the fused heads run their three GEMMs (logits, input gradient, weight gradient) in
# the autocast dtype and the rest in float32, still computing their gradients in forward, the float32
# weight getting a float32 gradient (row-sparse where sampled). The tolerances, from the dtype's unit
# roundoff u (2^-8 for bfloat16, 2^-11 for float16): a logit sum_i x_i w_i with both operands and the
# product rounded (the sum itself accumulates in float32) is off by at most 3u sum_i |x_i w_i|, and a
# loss moves by at most its largest logit's error. Margin head: sum_i |x_i w_i| <= 1 for unit rows,
# times the scale and the slope of the target's margin, below 2 for the moderate cosines of random
# rows. Gradients: their error relative to their norm, ~u in practice (a bound per element would sum
# the rounding of the softmax gradient, of both GEMMs' operands and of the logits' error through the
# softmax), asserted within 8u.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_")
DTYPE_NAMES = {torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}
# (rows, classes): one block of rows holding every column; several blocks (the gradients-in-forward
# bound is 2^22 logits: 384 x 20000 makes two blocks of 192 rows); blocks thinner than 128 rows
# (200 x 40000), where the logits are computed chunk by chunk and again for the gradients.
SHAPES = {"one_block": (24, 300), "two_blocks": (384, 20000), "recomputed": (200, 40000)}
ARCFACE_MARGINS = (1.0, 0.5, 0.0)


def _gemm_operand_dtypes(step):
    """Runs ``step`` under the profiler: its result and the operand dtypes of every ATen GEMM it ran
    (cuBLASLt's GEMMs, which the fused linear head uses on CUDA, are not among them)."""
    from torch.profiler import profile
    with profile(record_shapes=True) as prof:
        out = step()
    return out, [tuple(e.dtypes()[:2]) for e in prof.profiler.kineto_results.events() if e.name() in GEMMS]


def _relative(actual, expected):
    actual = (actual.to_dense() if actual.is_sparse else actual).cpu().double()
    expected = expected.to_dense() if expected.is_sparse else expected
    return ((actual - expected.double()).norm() / expected.double().norm()).item()


def _check_reduced_precision(device, dtype, gemms, loss, loss_bound, grads, refs, float32):
    """The autocast step's GEMMs, loss and gradients against the float64 references and the float32
    op's result ``float32`` (loss, gradients)."""
    u = UNIT_ROUNDOFF[dtype]
    if device == "cpu":
        assert len(gemms) >= 3, gemms
    assert set(gemms) <= {(DTYPE_NAMES[dtype],) * 2}, gemms
    assert loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    assert abs(loss.item() - refs[0].item()) <= loss_bound
    assert abs(loss.item() - float32[0].item()) <= loss_bound
    for got, want, want32 in zip(grads, refs[1:], float32[1:]):
        assert _relative(got, want) <= 8 * u and _relative(got, want32.cpu()) <= 8 * u
    # Not float32 in disguise: the reduced precision's rounding shows.
    assert _relative(grads[0], refs[1]) > 10 * _relative(float32[1], refs[1])


def _run_linear_head(x, w, b, target, dtype, amp):
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast(x.device.type, dtype=dtype, enabled=amp):
        loss = ts.nn.functional.parallel_linear_cross_entropy(*args, target, label_smoothing=0.1)
    loss.backward()
    return [loss.detach()] + [a.grad for a in args]


def check_linear_cross_entropy_under_autocast(device, dtype, shape):
    from tests.reference import cross_entropy_reference
    rows, classes = SHAPES[shape]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 32, generator=g)
    w = torch.randn(classes, 32, generator=g) / 32 ** 0.5
    b = torch.randn(classes, generator=g) * 0.1
    target = torch.randint(0, classes, (rows,), generator=g)
    on = [t.to(device) for t in (x, w, b, target)]
    (loss, *grads), gemms = _gemm_operand_dtypes(lambda: _run_linear_head(*on, dtype, True))
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    ref = cross_entropy_reference(F.linear(x64, w64, b64), target, None, -100, "mean", 0.1)
    ref.backward()
    loss_bound = 3 * UNIT_ROUNDOFF[dtype] * (x.abs() @ w.abs().t()).max().item()
    _check_reduced_precision(device, dtype, gemms, loss, loss_bound, grads, (ref, x64.grad, w64.grad, b64.grad),
                             _run_linear_head(*on, dtype, False))


def _run_margin_head(x, w, target, kept, dtype, amp):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=dtype, enabled=amp):
        loss = ts.nn.functional.parallel_margin_cross_entropy(xs, ws, target, 16.0, ARCFACE_MARGINS,
                                                              sampled_classes=kept)
    loss.backward()
    return loss.detach(), xs.grad, ws.grad


def _margin_inputs(rows, classes, features, seed, sampled):
    """Random rows, weight and targets, and with ``sampled`` the kept classes (the targets' and
    about half of the others); the generator, for further draws."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g)
    w = torch.randn(classes, features, generator=g)
    target = torch.randint(0, classes, (rows,), generator=g)
    kept = None
    if sampled:
        kept = torch.unique(torch.cat([target, torch.randperm(classes, generator=g)[: classes // 2]]))
    return x, w, target, kept, g


def check_margin_loss_under_autocast(device, dtype, shape, sampled):
    from tests.reference import margin_cross_entropy_reference
    rows, classes = SHAPES[shape]
    if sampled:
        classes *= 2  # about half of them kept: the same columns as unsampled
    x, w, target, kept, _ = _margin_inputs(rows, classes, 32, 9, sampled)
    on = [x.to(device), w.to(device), target.to(device), None if kept is None else kept.to(device)]
    (loss, gx, gw), gemms = _gemm_operand_dtypes(lambda: _run_margin_head(*on, dtype, True))
    if sampled:
        assert gw.layout == torch.sparse_coo and torch.equal(gw.coalesce().indices()[0].cpu(), kept)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = margin_cross_entropy_reference(x64, w64, target, 16.0, ARCFACE_MARGINS, kept_classes=kept)
    ref.backward()
    loss_bound = 2 * 3 * UNIT_ROUNDOFF[dtype] * 16.0
    _check_reduced_precision(device, dtype, gemms, loss, loss_bound, (gx, gw), (ref, x64.grad, w64.grad),
                             _run_margin_head(*on, dtype, False))


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_cross_entropy_gemms_run_in_bfloat16_under_autocast(world_of_one, shape):
    check_linear_cross_entropy_under_autocast("cpu", torch.bfloat16, shape)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_margin_loss_gemms_run_in_bfloat16_under_autocast(world_of_one, shape, sampled):
    check_margin_loss_under_autocast("cpu", torch.bfloat16, shape, sampled)


# Every reduction under autocast. 'mean' and 'sum' compute the gradients in forward; 'none' (one
# loss per row) leaves them to the separate backward, which recomputes the logits: it must run its
# GEMMs in the forward's dtype too, since the saved statistics came from the reduced-precision
# logits (float32 logits against them make softmax rows that no longer sum to one). Logits of
# standard deviation 23 (64 rows x 3,000 classes x 256 features) make a mismatch show: every
# reduction is held to the bound the mean path meets (8u, above), and every GEMM of forward and
# backward must run in the autocast dtype. For 'none' the upstream gradient differs per row.
REDUCTIONS = ("mean", "sum", "none")


def _backward(loss, upstream):
    if upstream is None:
        loss.backward()
    else:
        loss.backward(upstream.to(loss.dtype).to(loss.device))


def _check_every_reduction(device, dtype, step, reference):
    """``step()`` -> (loss, gradients) under autocast, ``reference(upstream)`` -> (loss, gradients)
    in float64; the same bounds for every reduction."""
    u = UNIT_ROUNDOFF[dtype]
    (loss, grads), gemms = _gemm_operand_dtypes(step)
    ref_loss, ref_grads = reference()
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.float32
        assert _relative(got, want) <= 8 * u, (_relative(got, want), 8 * u)
    # The forward's and the backward's GEMMs (on the CPU at least three; float32 ones may run
    # through oneDNN, not aten::mm, so the count is what catches them there).
    if device == "cpu":
        assert len(gemms) >= 3, gemms
    assert set(gemms) <= {(DTYPE_NAMES[dtype],) * 2}, gemms
    return loss, ref_loss


def check_linear_cross_entropy_every_reduction(device, dtype, reduction):
    from tests.reference import cross_entropy_reference
    g = torch.Generator().manual_seed(11)
    rows, classes, features = 64, 3000, 256
    x = torch.randn(rows, features, generator=g)
    w = torch.randn(classes, features, generator=g) * (23 / features ** 0.5)
    b = torch.randn(classes, generator=g)
    target = torch.randint(0, classes, (rows,), generator=g)
    upstream = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5 if reduction == "none" else None
    args = [t.to(device, copy=True).requires_grad_() for t in (x, w, b)]

    def step():
        with torch.autocast(device, dtype=dtype):
            loss = ts.nn.functional.parallel_linear_cross_entropy(*args, target.to(device),
                                                                  reduction=reduction)
        _backward(loss, upstream)
        return loss.detach(), [a.grad for a in args]

    def reference():
        x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
        ref = cross_entropy_reference(F.linear(x64, w64, b64), target, None, -100, reduction)
        _backward(ref, upstream)
        return ref.detach(), [x64.grad, w64.grad, b64.grad]

    loss, ref = _check_every_reduction(device, dtype, step, reference)
    # A row's loss is off by at most its largest logit's error (3u sum_i |x_i w_i|), and by one
    # rounding of the bias added in float32.
    row_bound = 3 * UNIT_ROUNDOFF[dtype] * (x.abs() @ w.abs().t()).max().item() + 1e-6
    bound = {"mean": row_bound, "sum": rows * row_bound, "none": row_bound}[reduction]
    assert (loss.cpu().double() - ref).abs().max().item() <= bound


def check_margin_loss_every_reduction(device, dtype, reduction, sampled):
    from tests.reference import margin_cross_entropy_reference
    rows, classes, features, scale = 64, 3000, 256, 64.0
    x, w, target, kept, g = _margin_inputs(rows, classes, features, 12, sampled)
    upstream = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5 if reduction == "none" else None
    xs, ws = (t.to(device, copy=True).requires_grad_() for t in (x, w))

    def step():
        with torch.autocast(device, dtype=dtype):
            loss = ts.nn.functional.parallel_margin_cross_entropy(
                xs, ws, target.to(device), scale, ARCFACE_MARGINS, reduction=reduction,
                sampled_classes=None if kept is None else kept.to(device))
        _backward(loss, upstream)
        return loss.detach(), [xs.grad, ws.grad]

    def reference():
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        ref = margin_cross_entropy_reference(x64, w64, target, scale, ARCFACE_MARGINS, reduction=reduction,
                                             kept_classes=kept)
        _backward(ref, upstream)
        return ref.detach(), [x64.grad, w64.grad]

    loss, ref = _check_every_reduction(device, dtype, step, reference)
    row_bound = 2 * 3 * UNIT_ROUNDOFF[dtype] * scale
    bound = {"mean": row_bound, "sum": rows * row_bound, "none": row_bound}[reduction]
    assert (loss.cpu().double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_every_reduction_in_the_autocast_dtype(world_of_one, reduction):
    check_linear_cross_entropy_every_reduction("cpu", torch.bfloat16, reduction)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_margin_loss_every_reduction_in_the_autocast_dtype(world_of_one, reduction, sampled):
    check_margin_loss_every_reduction("cpu", torch.bfloat16, reduction, sampled)
