"""The parallel cross-entropy with class-probability (soft) targets in one
process (a world-1 group): against F.cross_entropy in float64, forward and
logit gradient, opcheck, gradcheck, TorchScript, torch.compile, autocast, and
the errors. The sharded layouts run in tests/distributed/cases_probability_targets.py."""
import pytest
import torch

import shardtorch as ts
from tests.reference import assert_compiled_matches_eager, expect_error, probability_cross_entropy_reference

OPS = torch.ops.shard
F_TS = ts.nn.functional
CODES = {"none": 0, "mean": 1, "sum": 2}


def _inputs(rows=6, classes=7, dtype=torch.float64, seed=0, shape=None):
    """Logits, a random probability target (rows of a softmax, so unlike a
    one-hot it touches every class), class weights."""
    g = torch.Generator().manual_seed(seed)
    shape = shape or (rows,)
    logits = (torch.randn(*shape, classes, dtype=torch.float64, generator=g) * 3).to(dtype)
    probs = torch.randn(*shape, classes, dtype=torch.float64, generator=g).mul(2).softmax(-1)
    weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5
    return logits, probs, weight


def _loss_and_grad(logits, probs, weight, reduction, smoothing, z_loss, upstream):
    x = logits.clone().requires_grad_()
    loss = F_TS.parallel_cross_entropy(x, probs, weight, -100, reduction, smoothing, z_loss, parallel=True)
    (loss.double() * upstream).sum().backward()
    return loss, x.grad


def _reference(logits, probs, weight, reduction, smoothing, z_loss, upstream):
    x = logits.double().clone().requires_grad_()
    ref = probability_cross_entropy_reference(x, probs.double(), None if weight is None else weight.double(),
                                              reduction, smoothing, z_loss)
    (ref * upstream).sum().backward()
    return ref.detach(), x.grad


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing,z_loss", [(0.0, 0.0), (0.2, 0.0), (0.1, 1e-2), (1.0, 0.0)])
def test_matches_torch_float64(reduction, weighted, smoothing, z_loss):
    logits, probs, weight = _inputs()
    w = weight if weighted else None
    upstream = torch.randn(6 if reduction == "none" else (), dtype=torch.float64)
    loss, grad = _loss_and_grad(logits, probs, w, reduction, smoothing, z_loss, upstream)
    ref, ref_grad = _reference(logits, probs, w, reduction, smoothing, z_loss, upstream)
    assert loss.shape == ref.shape
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_any_real_target_as_torch_takes_it():
    """torch does not ask a probability target to be non-negative or to sum to
    1 (label distributions, a teacher's scaled scores): neither does the op.
    A row of zeros (its softmax term's coefficient is 0) and a row summing to 0
    with weights are the edge cases of the gradient's row scale."""
    logits, _, weight = _inputs(rows=5, classes=6, seed=4)
    probs = torch.randn(5, 6, dtype=torch.float64)
    probs[1] = 0.0
    probs[2] = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / weight
    for w in (None, weight):
        upstream = torch.randn(5, dtype=torch.float64)
        loss, grad = _loss_and_grad(logits, probs, w, "none", 0.0, 0.0, upstream)
        ref, ref_grad = _reference(logits, probs, w, "none", 0.0, 0.0, upstream)
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_3d_shapes_and_logits_not_modified(reduction):
    logits, probs, weight = _inputs(classes=5, shape=(2, 3))
    before = logits.clone()
    upstream = torch.randn((2, 3) if reduction == "none" else (), dtype=torch.float64)
    loss, grad = _loss_and_grad(logits, probs, weight, reduction, 0.1, 1e-3, upstream)
    assert torch.equal(logits, before)
    ref, ref_grad = _reference(logits, probs, weight, reduction, 0.1, 1e-3, upstream)
    assert loss.shape == ref.shape == ((2, 3) if reduction == "none" else ())
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("logits_dtype,target_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16), (torch.float64, torch.float32)])
def test_reduced_precision_against_float64(logits_dtype, target_dtype):
    logits, probs, weight = _inputs(rows=8, classes=300, seed=2)
    logits, probs = logits.to(logits_dtype), probs.to(target_dtype)
    w = weight.to(logits_dtype)
    upstream = torch.randn((), dtype=torch.float64)
    loss, grad = _loss_and_grad(logits, probs, w, "mean", 0.1, 1e-3, upstream)
    ref, ref_grad = _reference(logits, probs, w, "mean", 0.1, 1e-3, upstream)
    assert loss.dtype == logits_dtype and grad.dtype == logits_dtype
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[logits_dtype]
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    # Gradients of 300 classes are ~1/300: compare them at their own scale.
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol / 100)


def test_batches_larger_than_one_block_of_rows():
    """The probability passes go over blocks of about 2**20 elements: 70 rows of
    16000 classes are two blocks, the second one short."""
    logits, probs, weight = _inputs(rows=70, classes=16000, seed=6)
    upstream = torch.randn(70, dtype=torch.float64)
    loss, grad = _loss_and_grad(logits, probs, weight, "none", 0.1, 1e-3, upstream)
    ref, ref_grad = _reference(logits, probs, weight, "none", 0.1, 1e-3, upstream)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_empty_batch_mean_is_nan_as_torch():
    logits, probs, weight = _inputs(rows=0)
    for reduction in ("mean", "sum", "none"):
        loss = F_TS.parallel_cross_entropy(logits, probs, weight, reduction=reduction, parallel=True)
        ref = probability_cross_entropy_reference(logits, probs, weight, reduction)
        torch.testing.assert_close(loss, ref, equal_nan=True)


def test_the_module_and_the_unmarked_fallback_agree():
    """ParallelCrossEntropyLoss: the op on a marked input, F.cross_entropy (plus
    the same z-loss term) on an unmarked one, 3-D included."""
    logits, probs, weight = _inputs(classes=5, shape=(2, 3))
    loss_fn = ts.nn.ParallelCrossEntropyLoss(weight, label_smoothing=0.1, z_loss=1e-2)
    plain = loss_fn(logits, probs)
    marked = loss_fn(ts.utils.register_parallel_dim(logits.clone(), -1), probs)
    ref = probability_cross_entropy_reference(logits, probs, weight, "mean", 0.1, 1e-2)
    torch.testing.assert_close(plain, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(marked, ref, rtol=1e-10, atol=1e-10)


def test_opcheck():
    logits, probs, weight = _inputs(rows=4, classes=6)
    for w, reduction, eps, z in ((None, 1, 0.0, 0.0), (weight, 0, 0.1, 1e-3), (weight, 2, 0.3, 0.0)):
        x = logits.clone().requires_grad_()
        torch.library.opcheck(OPS.parallel_cross_entropy.default, (x, probs, w, -100, eps, z, reduction, "tp", None))
        torch.library.opcheck(OPS._parallel_cross_entropy_forward.default,
                              (logits, probs, w, -100, eps, z, reduction, "tp", 6))
    _, buffer, stats = OPS._parallel_cross_entropy_forward(logits, probs, weight, -100, 0.1, 1e-3, 1, "tp", None)
    torch.library.opcheck(OPS._parallel_cross_entropy_backward.default,
                          (torch.tensor(1.0, dtype=torch.float64), buffer, stats, probs, weight, -100, 0.1, 1e-3, 1))


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_gradcheck(reduction):
    logits, probs, weight = _inputs(rows=3, classes=5)
    assert torch.autograd.gradcheck(
        lambda t: OPS.parallel_cross_entropy(t, probs, weight, -100, 0.2, 1e-2, reduction, "tp"),
        (logits.clone().requires_grad_(),))


def test_torchscript():
    def loss_fn(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.shard.parallel_cross_entropy(logits, target, weight, -100, 0.1, 1e-3, 1, "tp")

    scripted = torch.jit.script(loss_fn)
    logits, probs, weight = _inputs()
    x = logits.clone().requires_grad_()
    loss = scripted(x, probs, weight)
    loss.backward()
    ref, ref_grad = _reference(logits, probs, weight, "mean", 0.1, 1e-3, torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    logits, probs, weight = _inputs(rows=6, classes=9)

    def step(x):
        soft = OPS.parallel_cross_entropy(x, probs, weight, -100, 0.1, 1e-3, 1, "tp")
        per_row = OPS.parallel_cross_entropy(x, probs, None, -100, 0.0, 0.0, 0, "tp")
        return soft + per_row.sum()

    assert_compiled_matches_eager(step, (logits,))


def test_autocast_casts_logits_and_target_to_float32():
    logits, probs, weight = _inputs(rows=8, classes=11, dtype=torch.float32, seed=5)
    probs = probs.float()
    reference = F_TS.parallel_cross_entropy(logits, probs, weight.float(), label_smoothing=0.1, parallel=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F_TS.parallel_cross_entropy(logits.bfloat16(), probs.bfloat16(), weight.float(), label_smoothing=0.1,
                                           parallel=True)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=2e-2, atol=2e-2)


def test_errors_name_the_argument_the_rule_and_the_value():
    logits, probs, weight = _inputs(rows=4, classes=6)
    expect_error(lambda: OPS.parallel_cross_entropy(logits, probs.float().half()), "parallel_cross_entropy",
                 "a probability target must have the logits' dtype (Double) or float32, got Half")
    expect_error(lambda: OPS.parallel_cross_entropy(logits, probs[:, :5].contiguous()), "parallel_cross_entropy",
                 "a probability target's last dim must be this rank's 6 classes", "all num_classes=6, got 5")
    expect_error(lambda: OPS.parallel_cross_entropy(logits, probs[0]), "parallel_cross_entropy",
                 "a probability target must be shaped like the logits", "got shape [6]")
    expect_error(lambda: OPS.parallel_cross_entropy(logits, probs[:3]), "target shape [3, 6] must match")
    expect_error(lambda: OPS.parallel_cross_entropy(logits, probs.int()), "parallel_cross_entropy",
                 "target must be int64 class indices [*] or floating class probabilities", "got Int")
    grad_probs = probs.clone().requires_grad_()
    expect_error(lambda: OPS.parallel_cross_entropy(logits, grad_probs),
                 "gradient with respect to a probability target is not supported", "target.detach()")
    with torch.no_grad():  # no gradient asked for: fine
        OPS.parallel_cross_entropy(logits, grad_probs)
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    expect_error(lambda: F_TS.parallel_margin_cross_entropy(x, w, probs), "parallel_linear_margin_cross_entropy",
                 "the margin loss is not defined for a probability (floating) target, got Double")


def _confident(rows, classes, dtype, seed, scale=1000.0):
    """Logits near `scale` with one class 12 ahead in each row, and a target
    that puts all but 1e-6 per class on that class: the loss (about 0.1) is
    a small difference of sums near scale, which a float32 sum of p z loses
    (its rounding is about scale * 6e-8 per term)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, classes, dtype=torch.float64, generator=g)
    top = torch.randint(0, classes, (rows,), generator=g)
    logits[torch.arange(rows), top] += 12.0
    logits = (logits + scale).to(dtype)
    probs = torch.full((rows, classes), 1e-6, dtype=torch.float64)
    probs[torch.arange(rows), top] = 1.0 - 1e-6 * (classes - 1)
    return logits, probs.to(dtype)


def _plain_float64_loss_and_grad(logits, probs, weight):
    """-sum_c w_c p_c log_softmax(z)_c per row and its logit gradient, in
    float64 from the given (already rounded) values, written out plainly."""
    z = logits.double().clone().requires_grad_()
    p = probs.double()
    w = torch.ones(z.shape[-1], dtype=torch.float64) if weight is None else weight.double()
    log_softmax = z - torch.logsumexp(z, -1, keepdim=True)
    loss = -(w * p * log_softmax).sum(-1)
    loss.sum().backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_large_confident_logits_do_not_cancel(dtype, weighted):
    """The loss A lse - B (A = sum w p, B = sum w p z) cancels for logits near
    1000 whose target sits on the row's top class: B is summed relative to
    the row's max, so both terms stay small. Relative error of each row's
    loss against float64 of the same rounded inputs."""
    logits, probs = _confident(rows=16, classes=3000, dtype=dtype, seed=11)
    weight = (torch.rand(3000, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype) if weighted else None
    x = logits.clone().requires_grad_()
    loss = F_TS.parallel_cross_entropy(x, probs, weight, -100, "none", 0.0, 0.0, parallel=True)
    loss.sum().backward()
    ref, ref_grad = _plain_float64_loss_and_grad(logits, probs, weight)
    assert (ref > 1e-3).all() and (ref < 0.5).all()  # small against lse ~ 1000
    eps = torch.finfo(dtype).eps
    # The loss: float32 sums of one sign over 3000 classes, then one rounding
    # into the dtype; the old float32 B was ~1e-4 off here (up to 0.8% of it).
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4 if dtype == torch.float32 else eps / 2, atol=0)
    # The gradient: float32's rounding of its terms (softmax and w p, each up
    # to max w), then one rounding into the dtype; bfloat16's second rounding
    # of the softmax term near 1 (before the probability term) was ~2e-3 off.
    w_max = 1.0 if weight is None else weight.double().max().item()
    f32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=eps / 2, atol=4 * f32 * w_max)


@pytest.mark.parametrize("logits_dtype,target_dtype", [
    (torch.float64, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_target_in_another_dtype_and_layout(logits_dtype, target_dtype):
    """The kernels read the target in its own dtype (the logits' or float32),
    and a target whose columns are not adjacent (a transposed view) as it is (its GPU twin in
    tests/gpu/test_probability_targets_cuda.py)."""
    logits, probs, _ = _inputs(rows=33, classes=517, seed=2)
    probs = probs.to(target_dtype)
    for target in (probs, probs.t().contiguous().t()):
        x = logits.to(logits_dtype).clone().requires_grad_()
        loss = F_TS.parallel_cross_entropy(x, target, None, -100, "sum", 0.1, 0.0, parallel=True)
        loss.backward()
        ref, ref_grad = _reference(logits.to(logits_dtype), probs, None, "sum", 0.1, 0.0, 1.0)
        tol = {torch.float64: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[logits_dtype]
        torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad.double(), ref_grad, rtol=tol, atol=tol / 100)
