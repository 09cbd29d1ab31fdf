"""parallel_linear_margin_cross_entropy in one process (a world-1 group):
opcheck, gradcheck, TorchScript, torch.compile, sampled classes, errors, and
its memory against the class count. Multi-rank semantics: tests/distributed/
cases_margin.py."""
import pytest
import torch

import shardtorch as ts
from tests.ops.test_cross_entropy_ops import _peak_bytes_of
from tests.reference import assert_compiled_matches_eager, margin_cross_entropy_reference

OPS = torch.ops.shard
ARCFACE = ts.nn.MARGIN_PRESETS["arcface"]


def _inputs(rows=6, classes=9, features=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g, dtype=dtype)
    w = torch.randn(classes, features, generator=g, dtype=dtype)
    target = torch.randint(0, classes, (rows,), generator=g)
    return x, w, target


def test_opcheck():
    x, w, target = _inputs()
    target[0] = -100
    kept = torch.unique(torch.cat([target[target >= 0], torch.tensor([0, 8])]))
    for margins, easy, reduction, sampled in ((ARCFACE, False, 1, None), ((1.0, 0.0, 0.35), True, 0, None),
                                              ((1.35, 0.2, 0.1), False, 2, kept)):
        args = (x.clone().requires_grad_(), w.clone().requires_grad_(), target, 16.0, *margins, easy,
                -100, 0.1, reduction, sampled, 4, "tp", None)
        if sampled is None:  # the sampled weight gradient is sparse: opcheck's autograd check compares dense
            torch.library.opcheck(OPS.parallel_linear_margin_cross_entropy.default, args)
        torch.library.opcheck(OPS._parallel_linear_margin_cross_entropy_forward.default,
                              (x, w, target, 16.0, *margins, easy, -100, 0.1, reduction, sampled, 4, "tp", 9))
        _, stats = OPS._parallel_linear_margin_cross_entropy_forward(x, w, target, 16.0, *margins, easy, -100,
                                                                     0.1, reduction, sampled, 4, "tp", 9)
        grad = torch.ones(6, dtype=torch.float64) if reduction == 0 else torch.tensor(1.0, dtype=torch.float64)
        torch.library.opcheck(OPS._parallel_linear_margin_cross_entropy_backward.default,
                              (grad, x, w, stats, target, 16.0, *margins, easy, -100, 0.1, reduction, sampled,
                               4, "tp", [True, True]))


@pytest.mark.parametrize("margins,easy", [(ARCFACE, False), (ARCFACE, True), ((1.0, 0.0, 0.35), False),
                                          ((1.35, 0.3, 0.2), False)])
def test_gradcheck(margins, easy):
    x, w, target = _inputs(rows=4, classes=5, features=3, seed=1)
    target[2] = -100
    assert torch.autograd.gradcheck(
        lambda i, ww: OPS.parallel_linear_margin_cross_entropy(i, ww, target, 4.0, *margins, easy, -100, 0.2,
                                                               1, None, 2, "tp"),
        (x.requires_grad_(), w.requires_grad_()))


def test_sampled_classes_restrict_the_loss_and_give_a_sparse_gradient():
    x, w, target = _inputs(rows=5, classes=11, features=4, seed=2)
    kept = torch.unique(torch.cat([target, torch.tensor([0, 10, 4])]))
    x_a, w_a = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = ts.nn.functional.parallel_margin_cross_entropy(x_a, w_a, target, 16.0, ARCFACE, label_smoothing=0.1,
                                                          sampled_classes=kept, chunk_size=3)
    loss.backward()
    x_r, w_r = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = margin_cross_entropy_reference(x_r, w_r, target, 16.0, ARCFACE, label_smoothing=0.1, kept_classes=kept)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x_a.grad, x_r.grad, rtol=1e-10, atol=1e-10)
    assert w_a.grad.layout == torch.sparse_coo
    assert torch.equal(w_a.grad.coalesce().indices()[0], kept)
    torch.testing.assert_close(w_a.grad.to_dense(), w_r.grad, rtol=1e-10, atol=1e-10)


def test_sampled_classes_errors():
    x, w, target = _inputs(rows=4, classes=9, seed=3)
    target = torch.tensor([1, 5, 5, 7])
    fn = ts.nn.functional.parallel_margin_cross_entropy
    for kept, fragment in ((torch.tensor([1, 5]), "a target that is not among them"),
                           (torch.tensor([1, 7, 5]), "indices not strictly increasing"),
                           (torch.tensor([1, 5, 7, 9]), "an index out of range")):
        with pytest.raises(RuntimeError, match="sampled_classes must be strictly increasing") as info:
            fn(x, w, target, sampled_classes=kept)
        assert fragment in str(info.value)
    with pytest.raises(RuntimeError, match="sampled_classes must be a 1-D int64 tensor"):
        fn(x, w, target, sampled_classes=torch.tensor([1.0, 5.0, 7.0]))


def test_torchscript():
    def loss_fn(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.ops.shard.parallel_linear_margin_cross_entropy(x, w, target, 16.0, 1.0, 0.5, 0.0, False,
                                                                    -100, 0.1, 1, None, 4, "tp")

    scripted = torch.jit.script(loss_fn)
    x, w, target = _inputs()
    x_a, w_a = x.clone().requires_grad_(), w.clone().requires_grad_()
    scripted(x_a, w_a, target).backward()
    x_r, w_r = x.clone().requires_grad_(), w.clone().requires_grad_()
    margin_cross_entropy_reference(x_r, w_r, target, 16.0, ARCFACE, label_smoothing=0.1).backward()
    torch.testing.assert_close(x_a.grad, x_r.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w_a.grad, w_r.grad, rtol=1e-10, atol=1e-10)


def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    x0, w0, target = _inputs(rows=6, classes=9)
    target[3] = -100

    def step(x, w):
        arc = OPS.parallel_linear_margin_cross_entropy(x, w, target, 32.0, 1.0, 0.5, 0.0, False, -100, 0.0, 1,
                                                       None, 4, "tp")
        cos = OPS.parallel_linear_margin_cross_entropy(x, w, target, 32.0, 1.0, 0.0, 0.35, True, -100, 0.1, 2,
                                                       None, 4, "tp")
        return arc + cos

    assert_compiled_matches_eager(step, (x0, w0))


def test_peak_memory_is_bounded_whatever_the_classes():
    """Forward and backward of the margin loss at 256 rows: beyond the weight
    gradient it must return, what the loss holds is at most a block of 2**22
    logits (32768 classes: gradients in forward, two blocks of 128 rows) and
    flat in the class count beyond (65536 and 131072: blocks would be too
    thin, the logits are recomputed chunk by chunk) but for the weight rows'
    norms the head keeps, one float32 per class; the control, cosine logits
    materialised, grows by [rows, classes]."""
    torch.manual_seed(0)
    rows, features, chunk = 256, 8, 2048
    x = torch.randn(rows, features, requires_grad=True)
    target = torch.randint(0, 2048, (rows,))
    fused, control = {}, {}
    for classes in (32768, 65536, 131072):
        w = torch.randn(classes, features, requires_grad=True)

        def run_fused():
            ts.nn.functional.parallel_margin_cross_entropy(x, w, target, 64.0, ARCFACE,
                                                           chunk_size=chunk).backward()

        def run_control():
            logits = torch.nn.functional.normalize(x) @ torch.nn.functional.normalize(w).t()
            torch.nn.functional.cross_entropy(logits * 64.0, target).backward()

        runs = ((run_fused, fused), (run_control, control))
        for run, peaks in runs if classes < 131072 else runs[:1]:
            if classes == 32768:  # warm up lazily allocated state once; at more classes it could only raise the peak
                run()
                w.grad = x.grad = None
            peaks[classes] = _peak_bytes_of(run) - w.numel() * w.element_size()
            w.grad = x.grad = None
    assert control[65536] - control[32768] >= rows * 32768 * 4, (fused, control)
    # The block (2**22 float32), one chunk of it made before it is copied in,
    # the CPU row passes' temporaries (1 MiB), per-row statistics.
    block = (1 << 22) * 4
    assert block <= fused[32768] <= block + 128 * chunk * 4 + (1 << 20) + (256 << 10), (fused, control)
    assert 0 < fused[65536] <= rows * chunk * 4 * 8, fused
    assert fused[131072] <= fused[65536] + (131072 - 65536) * 4 + 64 * 1024, (fused, control)


@pytest.mark.parametrize("rows,classes,sampled", [
    (400, 16000, False),  # two blocks of rows (2**22 // 16000 = 262 of 400)
    (400, 16000, True),   # sampled: the kept count decides (about 5,400: one block of all rows)
    (160, 70000, False),  # blocks would be 59 rows: the logits computed twice in forward
])
def test_gradients_in_forward_paths_match_reference_float64(world_of_one, rows, classes, sampled):
    """The margin loss's gradients-in-forward paths against the float64
    formulas on the whole logits, with an ignored row, smoothing and an
    upstream gradient that is not 1; sampled: restricted to the kept classes,
    the sparse weight gradient holding exactly the kept rows."""
    x, w, target = _inputs(rows=rows, classes=classes, features=5, seed=classes)
    target[3] = -100
    margins = (1.2, 0.3, 0.1)
    kept = None
    if sampled:
        g = torch.Generator().manual_seed(1)
        others = torch.randperm(classes, generator=g)[:5000]
        kept = torch.unique(torch.cat([target[target >= 0], others]))
    x_a, w_a = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = ts.nn.functional.parallel_margin_cross_entropy(x_a, w_a, target, 16.0, margins, label_smoothing=0.1,
                                                          sampled_classes=kept, chunk_size=4096)
    (1.5 * loss).backward()
    x_r, w_r = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = margin_cross_entropy_reference(x_r, w_r, target, 16.0, margins, label_smoothing=0.1,
                                         kept_classes=kept)
    (1.5 * ref).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x_a.grad, x_r.grad, rtol=1e-9, atol=1e-12)
    if sampled:
        assert w_a.grad.is_sparse and torch.equal(w_a.grad.coalesce().indices()[0], kept)
        torch.testing.assert_close(w_a.grad.to_dense(), w_r.grad, rtol=1e-9, atol=1e-12)
    else:
        torch.testing.assert_close(w_a.grad, w_r.grad, rtol=1e-9, atol=1e-12)


def test_autocast_gives_a_float32_loss_and_gradients_in_the_leaves_dtypes():
    # Its GEMMs run in bfloat16 (tests/ops/test_autocast.py checks how closely).
    x, w, target = _inputs(rows=8, classes=11, features=6, seed=4, dtype=torch.float32)
    reference = ts.nn.functional.parallel_margin_cross_entropy(x, w, target, 16.0, ARCFACE)
    x_low = x.bfloat16().requires_grad_()
    w_leaf = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ts.nn.functional.parallel_margin_cross_entropy(x_low, w_leaf, target, 16.0, ARCFACE)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=2e-2, atol=2e-2)
    loss.backward()
    assert x_low.grad.dtype == torch.bfloat16 and w_leaf.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BFloat16"), (torch.float16, "Half")])
def test_a_reduced_precision_weight_with_a_float32_input_is_refused_clearly(dtype, name):
    # The fused cross-entropy accepts this mix; the margin op has no such path
    # and used to fail inside at::mm with ATen's own message.
    x, w, target = _inputs(rows=4, classes=9, dtype=torch.float32)
    for sampled in (None, torch.arange(9)):
        with pytest.raises(RuntimeError, match=r"parallel_linear_margin_cross_entropy: input and weight must have "
                                               r"the same dtype .*got Float and " + name):
            ts.nn.functional.parallel_margin_cross_entropy(x, w.to(dtype), target, 16.0, ARCFACE,
                                                           sampled_classes=sampled)


def test_autocast_with_a_bfloat16_sampled_margin_loss_gives_its_weight_a_row_sparse_gradient():
    # ParallelMarginLoss(dtype=bfloat16) under CPU autocast: the float32 cast of
    # the weight must hand the row-sparse gradient back row-sparse (aten's cast
    # failed: "ToCopyBackward ... doesn't support converting to a different layout").
    torch.manual_seed(7)
    loss_fn = ts.nn.ParallelMarginLoss(8, 64, sample_rate=0.5, dtype=torch.bfloat16, chunk_size=16)
    x = torch.randn(6, 8, requires_grad=True)
    target = torch.randint(0, 64, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(x, target)
    loss.backward()
    kept = loss_fn.last_sampled_classes
    grad = loss_fn.weight.grad
    assert grad.layout == torch.sparse_coo and grad.dtype == torch.bfloat16
    assert torch.equal(grad.coalesce().indices()[0], kept)
    # The reference: float64 over the same (bfloat16-rounded) weight and the same kept classes.
    x64 = x.detach().double().requires_grad_()
    w64 = loss_fn.weight.detach().double().requires_grad_()
    ref = margin_cross_entropy_reference(x64, w64, target, loss_fn.scale, loss_fn.margins, kept_classes=kept)
    ref.backward()
    # The GEMMs in bfloat16 (unit roundoff u = 2^-8): a logit off by at most 3u * scale * the
    # margin's slope (< 2 here), gradients within 8u of their norm (tests/ops/test_autocast.py).
    u = 2.0 ** -8
    assert abs(loss.item() - ref.item()) <= 2 * 3 * u * loss_fn.scale
    assert (x.grad.double() - x64.grad).norm() <= 8 * u * x64.grad.norm()
    assert (grad.to_dense().double() - w64.grad).norm() <= 8 * u * w64.grad.norm()
    assert grad.coalesce().values().abs().sum() > 0


def _weight_of_very_different_norms(classes, features, dtype, seed):
    """Rows whose norms span 1e-6 to 1e6, one row of norm ~1e-14 and one of 0 (both below F.normalize's eps,
    1e-12, so that their norm is clamped and the projection does not apply)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(classes, features, generator=g, dtype=torch.float64)
    w /= w.norm(dim=1, keepdim=True)
    w *= (10.0 ** (12 * torch.rand(classes, 1, generator=g, dtype=torch.float64) - 6))
    w[1] *= 1e-14
    w[2] = 0.0
    return w.to(dtype)


def _margin_gradients_by_path(path, x, w, target, kept, chunk):
    """(loss, grad input, grad weight rows) from the op's internal entry points, so that each of the head's
    paths is exercised whatever the driver would choose: gradients in forward (rows in one block holding every
    column, made chunk by chunk where the rows are gathered), or the logits by chunks forward and again in the
    separate backward."""
    common = (16.0, 1.2, 0.3, 0.1, False, -100, 0.1, 1, kept, chunk, "tp")
    if path == "in_forward":
        loss, _, gx, gw = OPS._parallel_linear_margin_cross_entropy_forward_with_gradients(
            x, w, target, *common, None, [True, True])
        return loss, gx, gw
    loss, stats = OPS._parallel_linear_margin_cross_entropy_forward(x, w, target, *common, None)
    one = torch.ones((), dtype=torch.float64, device=x.device)
    gx, gw = OPS._parallel_linear_margin_cross_entropy_backward(one, x, w, stats, target, *common, [True, True])
    return loss, gx, gw


def check_weight_rows_of_very_different_norms(device, path, sampled, dtype, large=False):
    """The head normalises on the small side (without sampling column scales scale / n_j; with sampling the
    kept rows gathered as scale * w_j / n_j; then the weight gradient's rows projected, g_j - w_j (w_j . g_j) /
    n_j^2 where |w_j| >= eps): against F.normalize composed in float64, for rows whose norms span twelve orders
    of magnitude, a row below eps and a zero row (targets on them too). Compared row by row relative to each
    row's own norm, the gradients' rows being as different in size as the rows. ``large``: 67 features and
    more than 128 kept rows, so that the CPU row kernels' vector loops and their tails run
    (tests/ops/test_cpu_isa_variants.py). Also run on CUDA by tests/gpu/test_margin_cuda.py."""
    rows, classes, features, chunk = (40, 301, 67, 32) if large else (7, 23, 6, 4)
    w64 = _weight_of_very_different_norms(classes, features, torch.float64, seed=5)
    g = torch.Generator().manual_seed(6)
    x64 = torch.randn(rows, features, generator=g, dtype=torch.float64)
    if large:
        target = torch.randint(0, classes, (rows,), generator=g)
        target[:5] = torch.tensor([1, 2, 0, classes - 1, -100])
        others = set(range(0, classes, 2)) | {1, 2}
        kept = torch.tensor(sorted(others | set(target[target >= 0].tolist()))) if sampled else None
    else:
        target = torch.tensor([1, 2, 0, 22, -100, 7, 2])
        kept = torch.tensor([0, 1, 2, 5, 7, 8, 13, 21, 22]) if sampled else None
    on = (x64.to(device, dtype), w64.to(device, dtype), target.to(device), None if kept is None else kept.to(device))
    loss, gx, gw = _margin_gradients_by_path(path, *on, chunk)
    x_r, w_r = x64.clone().requires_grad_(), w64.to(dtype).double().requires_grad_()
    ref = margin_cross_entropy_reference(x_r, w_r, target, 16.0, (1.2, 0.3, 0.1), label_smoothing=0.1,
                                         kept_classes=kept)
    ref.backward()
    ref_gw = w_r.grad if kept is None else w_r.grad[kept]
    assert loss.dtype == gx.dtype == gw.dtype == dtype
    loss, gx, gw = loss.cpu().double(), gx.cpu().double(), gw.cpu().double()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(loss, ref.detach(), rtol=tol, atol=0)
    torch.testing.assert_close(gx, x_r.grad, rtol=tol, atol=tol * x_r.grad.abs().max().item())
    error = (gw - ref_gw).norm(dim=1)
    assert (error <= tol * ref_gw.norm(dim=1)).all(), (error / ref_gw.norm(dim=1))
    # The clamped rows' gradient is the unit gradient over eps (no projection): large, and checked above.
    assert ref_gw[1].norm() > 1e6


@pytest.mark.parametrize("path", ["in_forward", "by_chunks"])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_weight_rows_of_very_different_norms_match_f_normalize_float64(path, sampled, dtype):
    check_weight_rows_of_very_different_norms("cpu", path, sampled, dtype)
