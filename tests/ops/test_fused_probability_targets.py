"""The fused linear cross-entropy with class-probability (soft) targets in one
process (a world-1 group), against F.cross_entropy(F.linear(x, W, b), p) in
float64: every way the op computes its gradients (in forward by one or several
blocks of rows, in forward with the logits recomputed, the separate backward
for reduction none, without gradients, with a reduced-precision weight),
opcheck, gradcheck, TorchScript, torch.compile, autocast, the module and the
errors. The sharded layouts run in tests/distributed/cases_probability_targets.py."""
import pytest
import torch
import torch.nn.functional as F

import shardtorch as ts
from tests.reference import assert_compiled_matches_eager, expect_error, probability_cross_entropy_reference

OPS = torch.ops.shard
F_TS = ts.nn.functional


def _inputs(rows, classes, features=3, seed=0, leading=None):
    """x, W, b, a probability target (rows of a softmax: every class touched),
    class weights; float64."""
    g = torch.Generator().manual_seed(seed * 1000 + classes + rows)
    shape = leading or (rows,)
    x = torch.randn(*shape, features, dtype=torch.float64, generator=g)
    W = torch.randn(classes, features, dtype=torch.float64, generator=g)
    b = torch.randn(classes, dtype=torch.float64, generator=g)
    probs = torch.randn(*shape, classes, dtype=torch.float64, generator=g).mul(2).softmax(-1)
    weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5
    return x, W, b, probs, weight


def _reference(x, W, b, probs, weight, upstream, **kwargs):
    """Loss and the gradients of x, W, b of F.cross_entropy(F.linear(x, W, b), p)
    (plus the documented z-loss term), all float64, for sum(loss * upstream)."""
    xr, Wr, br = (t.double().clone().requires_grad_() for t in (x, W, b))
    ref = probability_cross_entropy_reference(F.linear(xr, Wr, br), probs.double(),
                                              None if weight is None else weight.double(), **kwargs)
    (ref * upstream).sum().backward()
    return ref.detach(), xr.grad, Wr.grad, br.grad


def _fused(x, W, b, probs, weight, upstream, chunk_size, **kwargs):
    xs, Ws, bs = (t.clone().requires_grad_() for t in (x, W, b))
    loss = F_TS.parallel_linear_cross_entropy(xs, Ws, bs, probs, weight, chunk_size=chunk_size, **kwargs)
    (loss.double() * upstream).sum().backward()
    return loss.detach(), xs.grad, Ws.grad, bs.grad


def _assert_matches(mine, ref, tol, what):
    for name, m, r in zip(("loss", "grad input", "grad weight", "grad bias"), mine, ref):
        assert m.shape == r.shape, (what, name, m.shape, r.shape)
        torch.testing.assert_close(m.double(), r, rtol=tol, atol=tol, msg=lambda s: f"{what} {name}: {s}")


# Each path the fused op takes to its gradients (the block rule of
# fused_head_gradient_block_rows: a block holds max(rows x chunk, 2**22)
# logits, and no fewer than 128 rows).
PATHS = [
    (160, 13, 4, "mean"),  # gradients in forward: one block of all rows, 13 classes in chunks of 4
    (160, 13, 4, "sum"),
    (400, 16000, 4096, "mean"),  # two blocks of rows (2**22 // 16000 = 262 rows of 400)
    (130, 40000, 1024, "sum"),  # blocks would be 104 rows: the logits are recomputed in forward
    (50, 13, 4, "none"),  # reduction none: forward by chunks, then the separate backward
]


@pytest.mark.parametrize("rows,classes,chunk,reduction", PATHS)
@pytest.mark.parametrize("weighted,smoothing,z_loss", [(False, 0.0, 0.0), (True, 0.15, 1e-3)])
def test_every_path_matches_torch_float64(rows, classes, chunk, reduction, weighted, smoothing, z_loss):
    x, W, b, probs, weight, = _inputs(rows, classes)
    w = weight if weighted else None
    upstream = torch.randn(rows if reduction == "none" else (), dtype=torch.float64) + 2.0
    kwargs = dict(reduction=reduction, label_smoothing=smoothing, z_loss=z_loss)
    mine = _fused(x, W, b, probs, w, upstream, chunk, **kwargs)
    ref = _reference(x, W, b, probs, w, upstream, **kwargs)
    _assert_matches(mine, ref, 1e-9, f"{rows}x{classes} chunk={chunk} {reduction} w={weighted} eps={smoothing}")


def test_full_smoothing_and_any_real_target():
    """Smoothing 1 (the target drops out), and targets torch takes without
    asking them to be distributions: negative entries and a row of zeros."""
    x, W, b, _, weight = _inputs(20, 9, seed=3)
    probs = torch.randn(20, 9, dtype=torch.float64)
    probs[4] = 0.0
    for smoothing, reduction in ((1.0, "mean"), (0.0, "sum"), (0.3, "none")):
        upstream = torch.randn(20 if reduction == "none" else (), dtype=torch.float64)
        kwargs = dict(reduction=reduction, label_smoothing=smoothing)
        _assert_matches(_fused(x, W, b, probs, weight, upstream, 4, **kwargs),
                        _reference(x, W, b, probs, weight, upstream, **kwargs), 1e-9, f"eps={smoothing}")


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_3d_input_and_target(reduction):
    x, W, b, probs, weight = _inputs(6, 7, leading=(2, 3))
    upstream = torch.randn((2, 3) if reduction == "none" else (), dtype=torch.float64)
    kwargs = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    mine = _fused(x, W, b, probs, weight, upstream, 3, **kwargs)
    assert mine[0].shape == ((2, 3) if reduction == "none" else ())
    _assert_matches(mine, _reference(x, W, b, probs, weight, upstream, **kwargs), 1e-9, reduction)


def test_only_the_gradients_autograd_needs_and_no_grad():
    """A frozen classifier (only the input's gradient), a frozen input (only
    the weight's), and the loss alone under no_grad, each against the reference."""
    x, W, b, probs, weight = _inputs(40, 11, seed=5)
    upstream = torch.tensor(1.5, dtype=torch.float64)
    ref = _reference(x, W, b, probs, weight, upstream, label_smoothing=0.1)
    xs = x.clone().requires_grad_()
    loss = F_TS.parallel_linear_cross_entropy(xs, W, None, probs, weight, label_smoothing=0.1, chunk_size=4)
    (loss * upstream).backward()
    ref_no_bias = _reference(x, W, torch.zeros_like(b), probs, weight, upstream, label_smoothing=0.1)
    torch.testing.assert_close(xs.grad, ref_no_bias[1], rtol=1e-9, atol=1e-12)
    Ws = W.clone().requires_grad_()
    loss = F_TS.parallel_linear_cross_entropy(x, Ws, b, probs, weight, label_smoothing=0.1, chunk_size=4)
    (loss * upstream).backward()
    torch.testing.assert_close(Ws.grad, ref[2], rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        loss = F_TS.parallel_linear_cross_entropy(x, W, b, probs, weight, label_smoothing=0.1, chunk_size=4)
    torch.testing.assert_close(loss, ref[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_weight_against_float64(weight_dtype):
    """A float32 input with a float16/bfloat16 weight (the mixed GEMMs autocast
    on CUDA passes): no gradients in forward, the separate backward; a
    float32 target."""
    x, W, b, probs, weight = _inputs(24, 300, features=8, seed=2)
    W16, b16 = W.to(weight_dtype), b.to(weight_dtype)
    xs = x.float().requires_grad_()
    Ws, bs = W16.clone().requires_grad_(), b16.clone().requires_grad_()
    loss = F_TS.parallel_linear_cross_entropy(xs, Ws, bs, probs.float(), weight.float(), label_smoothing=0.1,
                                              chunk_size=64)
    loss.backward()
    assert loss.dtype == torch.float32 and Ws.grad.dtype == weight_dtype and xs.grad.dtype == torch.float32
    ref = _reference(xs.detach(), W16, b16, probs.float(), weight.float(), torch.tensor(1.0, dtype=torch.float64),
                     label_smoothing=0.1)
    tol = 2e-2 if weight_dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(loss.double(), ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(xs.grad.double(), ref[1], rtol=tol, atol=tol / 10)
    # The weight's gradients are rounded to its dtype: compared at their own scale.
    for mine, theirs in ((Ws.grad, ref[2]), (bs.grad, ref[3])):
        torch.testing.assert_close(mine.double(), theirs, rtol=tol, atol=tol * theirs.abs().max().item())


def test_float32_target_with_float64_input():
    x, W, b, probs, weight = _inputs(30, 10, seed=4)
    upstream = torch.tensor(1.0, dtype=torch.float64)
    mine = _fused(x, W, b, probs.float(), weight, upstream, 4, label_smoothing=0.1)
    _assert_matches(mine, _reference(x, W, b, probs.float(), weight, upstream, label_smoothing=0.1), 1e-9, "f32")


def test_autocast_casts_the_target_to_float32():
    """On CPU the op runs wholly in float32 under autocast: a bfloat16 target
    follows the input up (it would fail the dtype rule otherwise)."""
    x, W, b, probs, weight = _inputs(16, 11, features=8, seed=6)
    head = torch.nn.Linear(8, 11)
    with torch.no_grad():
        head.weight.copy_(W)
        head.bias.copy_(b)
    target = probs.bfloat16()
    reference = probability_cross_entropy_reference(F.linear(x.float(), head.weight, head.bias).double(),
                                                    target.double(), weight, "mean", 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F_TS.parallel_linear_cross_entropy(x.float().bfloat16(), head.weight, head.bias, target,
                                                  weight.float(), label_smoothing=0.1, chunk_size=4)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), reference, rtol=2e-2, atol=2e-2)
    loss.backward()
    assert torch.isfinite(head.weight.grad).all() and head.weight.grad.abs().sum() > 0


def test_module_on_a_column_parallel_head():
    """ParallelLinearCrossEntropyLoss over a ParallelLinear(dim=1) head (one
    rank: all classes) and the plain-head fallback agree with the reference."""
    x, W, b, probs, weight = _inputs(12, 9, features=5, seed=7)
    ref = _reference(x, W, b, probs, weight, torch.tensor(1.0, dtype=torch.float64), label_smoothing=0.2)
    for dim in (1, None):
        linear = torch.nn.Linear(5, 9, dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(W)
            linear.bias.copy_(b)
        head = ts.nn.ParallelLinear.from_linear(linear, dim=dim)
        loss = ts.nn.ParallelLinearCrossEntropyLoss(head, weight, label_smoothing=0.2, chunk_size=4)(x, probs)
        loss.backward()
        torch.testing.assert_close(loss, ref[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(head.weight.grad, ref[2], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(head.bias.grad, ref[3], rtol=1e-9, atol=1e-12)


def test_opcheck():
    x, W, b, probs, weight = _inputs(4, 6)
    xg, Wg, bg = (t.clone().requires_grad_() for t in (x, W, b))
    for cw, reduction, chunk in ((None, 1, 4), (weight, 0, 2), (weight, 2, 64)):
        torch.library.opcheck(OPS.parallel_linear_cross_entropy.default,
                              (xg, Wg, bg, probs, cw, -100, 0.1, 1e-3, reduction, chunk, "tp", None))
        torch.library.opcheck(OPS._parallel_linear_cross_entropy_forward.default,
                              (x, W, b, probs, cw, -100, 0.1, 1e-3, reduction, chunk, "tp", 6))
    _, stats = OPS._parallel_linear_cross_entropy_forward(x, W, b, probs, weight, -100, 0.1, 0.0, 1, 4, "tp", None)
    torch.library.opcheck(OPS._parallel_linear_cross_entropy_backward.default,
                          (torch.tensor(1.0, dtype=torch.float64), x, W, b, stats, probs, weight,
                           -100, 0.1, 0.0, 1, 4, "tp", [True, True, True]))
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(OPS._parallel_linear_cross_entropy_forward_with_gradients.default,
                              (x, W, b, probs, weight, -100, 0.1, 1e-3, 1, 4, "tp", None, mask))


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_gradcheck(reduction):
    x, W, b, probs, weight = _inputs(3, 5, features=4)
    assert torch.autograd.gradcheck(
        lambda i, ww, bb: OPS.parallel_linear_cross_entropy(i, ww, bb, probs, weight, -100, 0.2, 1e-2,
                                                            reduction, 2, "tp"),
        tuple(t.clone().requires_grad_() for t in (x, W, b)))


def test_torchscript():
    def fused_fn(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.ops.shard.parallel_linear_cross_entropy(x, w, None, target, None, -100, 0.1, 0.0, 1, 4, "tp")

    scripted = torch.jit.script(fused_fn)
    x, W, b, probs, _ = _inputs(5, 7)
    xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
    loss = scripted(xs, Ws, probs)
    loss.backward()
    ref = _reference(x, W, torch.zeros_like(b), probs, None, torch.tensor(1.0, dtype=torch.float64),
                     label_smoothing=0.1)
    torch.testing.assert_close(loss, ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xs.grad, ref[1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(Ws.grad, ref[2], rtol=1e-9, atol=1e-12)


def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    _, _, _, probs, weight = _inputs(6, 9)

    def step(inp, w, b):
        mean = OPS.parallel_linear_cross_entropy(inp, w, b, probs, weight, -100, 0.1, 1e-3, 1, 4, "tp")
        per_row = OPS.parallel_linear_cross_entropy(inp, w, b, probs, None, -100, 0.0, 0.0, 0, 4, "tp")
        return mean + per_row.sum()

    x, W, b, _, _ = _inputs(6, 9, features=4, seed=1)
    assert_compiled_matches_eager(step, (x, W, b))


def test_errors_name_the_argument_the_rule_and_the_value():
    x, W, b, probs, weight = _inputs(4, 6)
    op = "parallel_linear_cross_entropy"
    expect_error(lambda: F_TS.parallel_linear_cross_entropy(x, W, b, probs.half()), op,
                 "a probability target must have the logits' dtype (Double) or float32, got Half")
    expect_error(lambda: F_TS.parallel_linear_cross_entropy(x, W, b, probs[:, :5].contiguous()), op,
                 "a probability target's last dim must be this rank's 6 classes", "all num_classes=6, got 5")
    expect_error(lambda: F_TS.parallel_linear_cross_entropy(x, W, b, probs[0]), op,
                 "a probability target must be shaped like the logits", "got shape [6]")
    expect_error(lambda: F_TS.parallel_linear_cross_entropy(x, W, b, probs[:3]), op, "target shape [3, 6] must match")
    expect_error(lambda: F_TS.parallel_linear_cross_entropy(x, W, b, probs.int()), op,
                 "target must be int64 class indices [*] or floating class probabilities", "got Int")
    grad_probs = probs.clone().requires_grad_()
    expect_error(lambda: F_TS.parallel_linear_cross_entropy(x, W, b, grad_probs), op,
                 "gradient with respect to a probability target is not supported", "target.detach()")
    with torch.no_grad():  # no gradient asked for: fine
        F_TS.parallel_linear_cross_entropy(x, W, b, grad_probs)
    expect_error(lambda: F_TS.parallel_margin_cross_entropy(x, W, probs), "parallel_linear_margin_cross_entropy",
                 "the margin loss is not defined for a probability (floating) target, got Double")


def _confident_head(rows, classes, features=16, seed=0):
    """x one-hot over `features` candidate classes spread over all classes,
    W = 12 on each candidate's feature, b near 1000 on a 2**-10 grid, so that
    every logit (b_c, or b_c + 12 on the row's top class) is exact in float32
    and float64 alike; the target puts all but 1e-6 a class on the top class."""
    g = torch.Generator().manual_seed(seed)
    candidates = torch.randperm(classes, generator=g)[:features]
    pick = torch.randint(0, features, (rows,), generator=g)
    x = torch.nn.functional.one_hot(pick, features).double()
    W = torch.zeros(classes, features, dtype=torch.float64)
    W[candidates, torch.arange(features)] = 12.0
    b = (1000.0 + torch.randn(classes, dtype=torch.float64, generator=g)).mul(1024).round().div(1024)
    probs = torch.full((rows, classes), 1e-6, dtype=torch.float64)
    probs[torch.arange(rows), candidates[pick]] = 1.0 - 1e-6 * (classes - 1)
    return x, W, b, probs


@pytest.mark.parametrize("reduction,chunk", [("sum", 4096), ("none", 512)])
def test_large_confident_logits_do_not_cancel(reduction, chunk):
    """probability_target.h's B summed relative to the row's max: in one
    block with gradients in forward ('sum'), and over chunks whose max grows
    from chunk to chunk ('none', then the separate backward). float32 against
    float64 of the same (exact) logits, written out plainly."""
    x, W, b, probs = _confident_head(rows=64, classes=3000)
    xs, Ws, bs = (t.float().requires_grad_() for t in (x, W, b))
    loss = F_TS.parallel_linear_cross_entropy(xs, Ws, bs, probs.float(), None, reduction=reduction,
                                              chunk_size=chunk)
    loss.sum().backward()
    z = (x @ W.t() + b).requires_grad_()
    row_loss = -(probs.float().double() * (z - torch.logsumexp(z, -1, keepdim=True))).sum(-1)
    ref = row_loss.sum() if reduction == "sum" else row_loss
    ref.sum().backward()
    assert (row_loss > 1e-3).all() and (row_loss < 0.5).all()  # small against lse ~ 1000
    # The old float32 B (sum of p z near 1000) was up to 0.8% of the loss off.
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-4, atol=0)
    # d loss / d b is the logit gradient summed over rows: float32's rounding
    # of its terms (softmax and p, at most 1) per row.
    f32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(bs.grad.double(), z.grad.sum(0), rtol=0, atol=4 * f32 * 64)
