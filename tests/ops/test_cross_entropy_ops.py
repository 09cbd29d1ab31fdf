"""The cross-entropy ops in one process (a world-1 group): against the float64
reference, opcheck, gradcheck, TorchScript, torch.compile, autocast, errors,
and the fused loss's memory against the class count."""
import pytest
import torch
import torch.distributed as dist

import shardtorch as ts
from tests.reference import assert_compiled_matches_eager, cross_entropy_reference

OPS = torch.ops.shard
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _inputs(rows=5, classes=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, classes, dtype=dtype, generator=g)
    target = torch.randint(0, classes, (rows,), generator=g)
    weight = torch.rand(classes, dtype=dtype, generator=g) + 0.5
    return logits, target, weight


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_masked_logits_match_torch(world_of_one, dtype, weighted, smoothing):
    """Classes masked out with -inf (not the target): torch's loss is finite
    without smoothing and +inf with it; the gradient of masked classes is 0.
    (Was NaN: the smoothing term 0 * -inf entered the loss unconditionally.)"""
    logits, target, weight = _inputs(rows=6, classes=3000, seed=3)
    logits[:, :1000] = float("-inf")
    logits[2, 1000:2999] = float("-inf")  # a row with a single live class
    target = target.clamp_min(1000)
    target[2] = 2999
    w = weight if weighted else None
    x = logits.to(dtype).clone().requires_grad_()
    loss = ts.nn.functional.parallel_cross_entropy(x, target, w, -100, "none", smoothing, 0.0, parallel=True)
    x_ref = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x_ref, target, w, reduction="none", label_smoothing=smoothing)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    if smoothing == 0.0:
        loss.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing,z_loss", [(0.0, 0.0), (0.2, 0.0), (0.1, 1e-2)])
def test_matches_reference_float64(reduction, weighted, smoothing, z_loss):
    logits, target, weight = _inputs(rows=6)
    target[4] = 2  # the class id that is ignored below
    w = weight if weighted else None
    for ignore_index in (-100, 2):
        target[1] = ignore_index
        x = logits.clone().requires_grad_()
        loss = ts.nn.functional.parallel_cross_entropy(x, target, w, ignore_index, reduction,
                                                       smoothing, z_loss, parallel=True)
        x_ref = logits.clone().requires_grad_()
        ref = cross_entropy_reference(x_ref, target, w, ignore_index, reduction, smoothing, z_loss)
        upstream = torch.randn_like(ref)
        (loss * upstream).sum().backward()
        (ref * upstream).sum().backward()
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-10)


def test_logits_are_not_modified_and_3d_shapes():
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    target = torch.randint(0, 5, (2, 3))
    before = logits.clone()
    x = logits.requires_grad_()
    loss = OPS.parallel_cross_entropy(x, target, None, -100, 0.1, 0.0, 0, "tp")
    assert loss.shape == (2, 3)
    loss.sum().backward()
    assert torch.equal(logits.detach(), before)
    ref = cross_entropy_reference(before, target, reduction="none", label_smoothing=0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)


def _opcheck_args():
    logits, target, weight = _inputs(rows=4, classes=6)
    target[0] = -100
    return logits, target, weight


def test_opcheck_parallel_cross_entropy():
    logits, target, weight = _opcheck_args()
    for w, reduction, eps, z in ((None, 1, 0.0, 0.0), (weight, 0, 0.1, 1e-3), (weight, 2, 0.3, 0.0)):
        x = logits.clone().requires_grad_()
        torch.library.opcheck(OPS.parallel_cross_entropy.default,
                              (x, target, w, -100, eps, z, reduction, "tp", None))
        torch.library.opcheck(OPS._parallel_cross_entropy_forward.default,
                              (logits, target, w, -100, eps, z, reduction, "tp", 6))


def test_opcheck_backward_ops():
    logits, target, weight = _opcheck_args()
    _, buffer, stats = OPS._parallel_cross_entropy_forward(logits, target, weight, -100, 0.1, 0.0,
                                                           1, "tp", None)
    torch.library.opcheck(OPS._parallel_cross_entropy_backward.default,
                          (torch.tensor(1.0, dtype=torch.float64), buffer, stats, target, weight,
                           -100, 0.1, 0.0, 1))
    x = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(6, 3, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64)
    _, stats = OPS._parallel_linear_cross_entropy_forward(x, w, b, target, None, -100, 0.0, 0.0, 1,
                                                          4, "tp", None)
    torch.library.opcheck(OPS._parallel_linear_cross_entropy_backward.default,
                          (torch.tensor(1.0, dtype=torch.float64), x, w, b, stats, target, None,
                           -100, 0.0, 0.0, 1, 4, "tp", [True, True, True]))
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(OPS._parallel_linear_cross_entropy_forward_with_gradients.default,
                              (x, w, b, target, weight, -100, 0.1, 1e-3, 1, 4, "tp", None, mask))


def test_opcheck_parallel_linear_cross_entropy():
    _, target, weight = _opcheck_args()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    for cw, reduction, chunk in ((None, 1, 4), (weight, 0, 2), (weight, 2, 64)):
        torch.library.opcheck(OPS.parallel_linear_cross_entropy.default,
                              (x, w, b, target, cw, -100, 0.1, 1e-3, reduction, chunk, "tp", None))
        torch.library.opcheck(OPS._parallel_linear_cross_entropy_forward.default,
                              (x.detach(), w.detach(), b.detach(), target, cw, -100, 0.1, 1e-3,
                               reduction, chunk, "tp", 6))


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_gradcheck(reduction):
    logits, target, weight = _inputs(rows=3, classes=5)
    target[2] = -100
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda t: OPS.parallel_cross_entropy(t, target, weight, -100, 0.2, 1e-2, reduction, "tp"),
        (x,))
    inp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda i, ww, bb: OPS.parallel_linear_cross_entropy(i, ww, bb, target, weight, -100, 0.2,
                                                            1e-2, reduction, 2, "tp"),
        (inp, w, b))


def test_torchscript():
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.ops.shard.parallel_cross_entropy(logits, target, None, -100, 0.1, 0.0, 1, "tp")

    def fused_fn(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.ops.shard.parallel_linear_cross_entropy(x, w, None, target, None, -100, 0.0,
                                                             0.0, 1, 4, "tp")

    scripted, scripted_fused = torch.jit.script(loss_fn), torch.jit.script(fused_fn)
    logits, target, _ = _inputs()
    x = logits.clone().requires_grad_()
    scripted(x, target).backward()
    x_ref = logits.clone().requires_grad_()
    cross_entropy_reference(x_ref, target, label_smoothing=0.1).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-10)
    inp = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    scripted_fused(inp, w, target).backward()
    assert inp.grad is not None and w.grad is not None


def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    logits, target, weight = _inputs(rows=6, classes=9)
    target[3] = -100

    def step(x, inp, w, b):
        plain = OPS.parallel_cross_entropy(x, target, weight, -100, 0.1, 1e-3, 1, "tp")
        fused = OPS.parallel_linear_cross_entropy(inp, w, b, target, None, -100, 0.0, 0.0, 2, 4, "tp")
        return plain + fused

    inp0 = torch.randn(6, 4, dtype=torch.float64)
    w0, b0 = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    assert_compiled_matches_eager(step, (logits, inp0, w0, b0))


def test_autocast_bfloat16_matches_float32_and_gradscaler():
    torch.manual_seed(3)
    x = torch.randn(16, 8)
    head = torch.nn.Linear(8, 11)
    target = torch.randint(0, 11, (16,))
    loss_fn = ts.nn.ParallelCrossEntropyLoss(label_smoothing=0.1, parallel=True)
    reference = loss_fn(head(x), target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(x)
        assert logits.dtype == torch.bfloat16
        loss = loss_fn(logits, target)
        fused = ts.nn.functional.parallel_linear_cross_entropy(x, head.weight, head.bias, target,
                                                                label_smoothing=0.1, chunk_size=4)
    assert loss.dtype == torch.float32 and fused.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=2e-2, atol=2e-2)
    # The fused loss's GEMMs run in bfloat16 (tests/ops/test_autocast.py checks how closely).
    torch.testing.assert_close(fused, reference, rtol=2e-2, atol=2e-2)
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    scaler.scale(loss).backward()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()
    scaler.step(opt)
    scaler.update()


def test_errors_name_op_argument_and_value():
    logits, target, _ = _inputs()
    bad = target.clone()
    bad[2] = 7
    with pytest.raises(RuntimeError, match=r"parallel_cross_entropy: target values must be in \[0, num_classes=7\).*got 7"):
        OPS.parallel_cross_entropy(logits, bad)
    with pytest.raises(RuntimeError,
                       match=r"target must be int64 class indices \[\*\] or floating class probabilities .*got Int"):
        OPS.parallel_cross_entropy(logits, target.int())
    with pytest.raises(RuntimeError, match="reduction must be 0 \\(none\\), 1 \\(mean\\) or 2 \\(sum\\), got 5"):
        OPS.parallel_cross_entropy(logits, target, reduction=5)
    with pytest.raises(RuntimeError, match="weight must hold this rank's 7 classes or all num_classes=7, got 3"):
        OPS.parallel_cross_entropy(logits, target, torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="must be rank 0's shard of num_classes=9"):
        OPS.parallel_cross_entropy(logits, target, num_classes=9)
    with pytest.raises(ValueError, match="reduction must be 'none', 'mean' or 'sum'"):
        ts.nn.ParallelCrossEntropyLoss(reduction="avg")


def test_unmarked_input_uses_plain_cross_entropy_and_marked_uses_the_op():
    logits, target, _ = _inputs()
    plain = ts.nn.ParallelCrossEntropyLoss(z_loss=1e-3)(logits, target)
    torch.testing.assert_close(plain, cross_entropy_reference(logits, target, z_loss=1e-3))
    marked = ts.utils.register_parallel_dim(logits.clone(), -1)
    out = ts.nn.ParallelCrossEntropyLoss(z_loss=1e-3)(marked, target)
    assert out.grad_fn is None or "ParallelCrossEntropy" in type(out.grad_fn).__name__
    torch.testing.assert_close(out, plain, rtol=1e-10, atol=1e-10)


def _peak_bytes_of(fn):
    """Peak tensor bytes alive while fn runs beyond those alive before, counted
    by shardtorch's CPU allocator tracking (it sees the temporaries inside C++
    ops; CPU torch has no allocator statistics of its own)."""
    from shardtorch.utils.memory import PeakMemory

    with PeakMemory("cpu") as peak:
        fn()
    return peak.peak_bytes


BLOCK_BOUND = 1 << 22  # kGradientBlockMinElements: the largest block of logits, in elements


def test_fused_peak_memory_is_bounded_whatever_the_classes():
    """The fused loss's extra memory is at most max(rows x chunk, 2**22)
    elements for any class count. Three counts at 256 rows: 32768 classes
    (gradients in forward, two blocks of 128 rows x all classes = 2**22
    elements), then 65536 and 131072 (blocks would be thinner than 128 rows:
    the logits are recomputed chunk by chunk), where the peak is flat."""
    torch.manual_seed(0)
    rows, features, chunk = 256, 8, 2048
    x = torch.randn(rows, features, requires_grad=True)
    target = torch.randint(0, 2048, (rows,))
    fused, unfused = {}, {}
    for classes in (32768, 65536, 131072):
        w = torch.randn(classes, features, requires_grad=True)
        b = torch.randn(classes, requires_grad=True)

        def run_fused():
            ts.nn.functional.parallel_linear_cross_entropy(x, w, b, target,
                                                           chunk_size=chunk).backward()

        def run_unfused():  # the control: logits [rows, classes] materialised
            logits = ts.utils.register_parallel_dim(torch.addmm(b, x, w.t()), -1)
            ts.nn.functional.parallel_cross_entropy(logits, target).backward()

        runs = (("fused", run_fused, fused), ("unfused", run_unfused, unfused))
        for name, run, peaks in runs if classes < 131072 else runs[:1]:
            run()  # warm up lazily allocated state
            w.grad = b.grad = x.grad = None
            # The parameter gradients are as large as the parameters and
            # unavoidable; the rest is what the loss adds.
            peaks[classes] = _peak_bytes_of(run) - (w.numel() + b.numel()) * w.element_size()
            w.grad = b.grad = x.grad = None
    # The measurement sees [rows, classes] tensors: the control grows by at
    # least one logits-sized tensor...
    assert unfused[65536] - unfused[32768] >= rows * 32768 * 4, (fused, unfused)
    # ...the block of the gradients-in-forward path stays within its bound,
    # plus the CPU row passes' temporaries (2**18 elements, 1 MiB) and the
    # per-row statistics...
    assert BLOCK_BOUND * 4 <= fused[32768] <= BLOCK_BOUND * 4 + (1 << 20) + (64 << 10), (fused, unfused)
    # ...and beyond it the loss does not grow with the classes at all.
    assert 0 < fused[65536] <= rows * chunk * 4 * 8, fused
    assert fused[131072] <= fused[65536] + 64 * 1024, (fused, unfused)


@pytest.mark.parametrize("rows,classes,chunk,reduction", [
    (160, 13, 4, "mean"),  # one block of all rows
    (160, 13, 4, "sum"),
    (400, 16000, 4096, "mean"),  # two blocks of rows (2**22 // 16000 = 262 rows of 400)
    (160, 70000, 1024, "sum"),  # blocks would be 59 rows: the logits are recomputed in forward
])
def test_gradients_in_forward_paths_match_reference_float64(world_of_one, rows, classes, chunk,
                                                            reduction):
    """Each way the fused loss computes its gradients in forward against the
    float64 reference: class weights, smoothing, z-loss, an ignored row, a
    bias, an upstream gradient that is not 1, and retain_graph (a second
    backward sees unscaled gradients again)."""
    g = torch.Generator().manual_seed(classes)
    features = 3
    x = torch.randn(rows, features, dtype=torch.float64, generator=g)
    W = torch.randn(classes, features, dtype=torch.float64, generator=g)
    b = torch.randn(classes, dtype=torch.float64, generator=g)
    target = torch.randint(0, classes, (rows,), generator=g)
    target[7] = -100
    weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5
    kwargs = dict(ignore_index=-100, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    xr, Wr, br = (t.clone().requires_grad_() for t in (x, W, b))
    ref = cross_entropy_reference(torch.nn.functional.linear(xr, Wr, br), target, weight, **kwargs)
    (2.5 * ref).backward()
    xs, Ws, bs = (t.clone().requires_grad_() for t in (x, W, b))
    loss = ts.nn.functional.parallel_linear_cross_entropy(xs, Ws, bs, target, weight,
                                                          chunk_size=chunk, **kwargs)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    (2.5 * loss).backward(retain_graph=True)
    for mine, theirs in ((xs, xr), (Ws, Wr), (bs, br)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-12)
    first = [t.grad.clone() for t in (xs, Ws, bs)]
    for t in (xs, Ws, bs):
        t.grad = None
    (2.5 * loss).backward()
    for t, f in zip((xs, Ws, bs), first):
        torch.testing.assert_close(t.grad, f, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_in_forward_give_an_infinite_logit_what_torch_gives(world_of_one, dtype):
    """A +inf logit (here a +inf bias, so in every row) makes the row's log-sum-exp NaN: torch's
    gradients are NaN wherever that row reaches, and the fused loss's are NaN in the same places,
    in its gradients-in-forward path (which keeps each logit as its exp) and in its separate
    backward (reduction none); not finite in some columns and NaN in others."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, dtype=dtype, generator=g)
    W = torch.randn(10, 4, dtype=dtype, generator=g)
    b = torch.randn(10, dtype=dtype, generator=g)
    b[3] = float("inf")
    target = torch.tensor([0, 1, 2, 5, 7, 9])
    xr, Wr, br = (t.detach().clone().double().requires_grad_() for t in (x, W, b))
    torch.nn.functional.cross_entropy(torch.nn.functional.linear(xr, Wr, br), target,
                                      reduction="sum").backward()
    for reduction in ("sum", "none"):
        xs, Ws, bs = (t.clone().requires_grad_() for t in (x, W, b))
        loss = ts.nn.functional.parallel_linear_cross_entropy(xs, Ws, bs, target, reduction=reduction)
        loss.sum().backward()
        for mine, theirs in ((xs, xr), (Ws, Wr), (bs, br)):
            assert torch.equal(mine.grad.isnan(), theirs.grad.isnan()), (reduction, mine.grad, theirs.grad)
            torch.testing.assert_close(mine.grad.double().nan_to_num(), theirs.grad.nan_to_num(),
                                       rtol=1e-5, atol=1e-5)


def test_gradients_in_forward_only_what_autograd_needs(world_of_one):
    """A frozen classifier (only the input needs a gradient) and a frozen
    input (only the weight does), each against the reference; everything
    ignored with reduction mean gives torch's NaN loss and zero gradients."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 4, dtype=torch.float64, generator=g)
    W = torch.randn(11, 4, dtype=torch.float64, generator=g)
    target = torch.randint(0, 11, (9,), generator=g)
    for needs_input in (True, False):
        xs, Ws = x.clone().requires_grad_(needs_input), W.clone().requires_grad_(not needs_input)
        xr, Wr = x.clone().requires_grad_(needs_input), W.clone().requires_grad_(not needs_input)
        ts.nn.functional.parallel_linear_cross_entropy(xs, Ws, None, target).backward()
        torch.nn.functional.cross_entropy(xr @ Wr.t(), target).backward()
        mine, theirs = (xs, xr) if needs_input else (Ws, Wr)
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-12)
        assert (Ws.grad if needs_input else xs.grad) is None
    ignored = torch.full((9,), -100)
    xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
    loss = ts.nn.functional.parallel_linear_cross_entropy(xs, Ws, None, ignored)
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr @ Wr.t(), ignored)
    assert loss.isnan() and ref.isnan()
    loss.backward()
    ref.backward()
    torch.testing.assert_close(xs.grad, xr.grad)
    torch.testing.assert_close(Ws.grad, Wr.grad)
    assert not xs.grad.isnan().any() and not Ws.grad.any()


def test_gradients_in_forward_refuse_create_graph(world_of_one):
    """Its gradients are constants of forward: differentiating them again
    would silently miss terms, so it raises."""
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    loss = ts.nn.functional.parallel_linear_cross_entropy(x, w, None, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)
