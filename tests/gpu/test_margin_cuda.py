"""The margin softmax on CUDA (the cross-entropy row kernels, cuBLAS chunk
products, NCCL in a world-1 group) against the formulas in float64; skipped
where no GPU is present."""
import pytest
import torch

import shardtorch as ts
from tests.reference import margin_cross_entropy_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not ts.cuda_built,
                                 reason="needs a CUDA device and shardtorch built with CUDA")]
PRESETS = ts.nn.MARGIN_PRESETS


@pytest.fixture(autouse=True)
def _needs_the_cuda_world(cuda_world_of_one):
    yield


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("preset", ["arcface", "cosface", "sphereface", "combined"])
@pytest.mark.parametrize("easy_margin", [False, True])
def test_matches_reference(dtype, tol, preset, easy_margin):
    torch.manual_seed(0)
    rows, classes, features = 37, 2003, 24
    x = torch.randn(rows, features, dtype=torch.float64)
    w = torch.randn(classes, features, dtype=torch.float64)
    target = torch.randint(0, classes, (rows,))
    x[::3] = -w[target[::3]] + 0.05 * x[::3]  # the fallback branch
    target[::7] = -100
    x, w, target = x.cuda(), w.cuda(), target.cuda()
    x_a, w_a = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    loss = ts.nn.functional.parallel_margin_cross_entropy(x_a, w_a, target, 32.0, PRESETS[preset], easy_margin,
                                                          label_smoothing=0.1, chunk_size=512)
    loss.backward()
    x_r, w_r = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = margin_cross_entropy_reference(x_r, w_r, target, 32.0, PRESETS[preset], easy_margin,
                                         label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x_a.grad.double(), x_r.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(w_a.grad.double(), w_r.grad, rtol=tol, atol=tol)


def test_sampled_classes_on_cuda():
    torch.manual_seed(1)
    x = torch.randn(16, 8, dtype=torch.float64, device="cuda")
    w = torch.randn(501, 8, dtype=torch.float64, device="cuda")
    target = torch.randint(0, 501, (16,), device="cuda")
    kept = torch.unique(torch.cat([target, torch.arange(0, 501, 7, device="cuda")]))
    w_a = w.clone().requires_grad_()
    loss = ts.nn.functional.parallel_margin_cross_entropy(x, w_a, target, 16.0, PRESETS["arcface"],
                                                          sampled_classes=kept, chunk_size=64)
    loss.backward()
    w_r = w.clone().requires_grad_()
    ref = margin_cross_entropy_reference(x, w_r, target, 16.0, PRESETS["arcface"], kept_classes=kept)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    assert w_a.grad.is_sparse
    torch.testing.assert_close(w_a.grad.to_dense(), w_r.grad, rtol=1e-10, atol=1e-10)
    opt = ts.optim.RowSparseAdam([w_a], lr=0.1)
    before = w_a.detach().clone()
    opt.step()
    moved = (w_a.detach() != before).any(1)
    not_kept = torch.ones(501, dtype=torch.bool, device="cuda")
    not_kept[kept] = False
    assert not moved[not_kept].any() and moved[kept].all()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("rows,classes,sampled", [
    (400, 16000, False),  # gradients in forward by two blocks of rows
    (400, 16000, True),   # sampled: one block over the kept classes
    (160, 70000, False),  # blocks too thin: the logits computed twice in forward
])
def test_gradients_in_forward_paths_match_reference(dtype, tol, rows, classes, sampled):
    g = torch.Generator().manual_seed(classes)
    x = torch.randn(rows, 24, dtype=torch.float64, generator=g)
    w = torch.randn(classes, 24, dtype=torch.float64, generator=g)
    target = torch.randint(0, classes, (rows,), generator=g)
    target[::9] = -100
    kept = None
    if sampled:
        others = torch.randperm(classes, generator=g)[:5000]
        kept = torch.unique(torch.cat([target[target >= 0], others])).cuda()
    x, w, target = x.cuda(), w.cuda(), target.cuda()
    x_a, w_a = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    loss = ts.nn.functional.parallel_margin_cross_entropy(x_a, w_a, target, 32.0, PRESETS["combined"],
                                                          label_smoothing=0.1, sampled_classes=kept)
    (2.0 * loss).backward()
    x_r, w_r = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = margin_cross_entropy_reference(x_r, w_r, target, 32.0, PRESETS["combined"], label_smoothing=0.1,
                                         kept_classes=kept)
    (2.0 * ref).backward()
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x_a.grad.double(), x_r.grad, rtol=tol, atol=tol)
    grad_w = w_a.grad.to_dense() if sampled else w_a.grad
    torch.testing.assert_close(grad_w.double(), w_r.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("path", ["in_forward", "by_chunks"])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_weight_rows_of_very_different_norms_match_f_normalize_float64(path, sampled, dtype):
    """The normalisation on the small side and the weight gradient's projection (a kernel of its own on
    CUDA, a warp per row; a loop of its own on the CPU) for rows of norms 1e-6 to 1e6, one below eps and a
    zero row."""
    from tests.ops.test_margin_ops import check_weight_rows_of_very_different_norms
    check_weight_rows_of_very_different_norms("cuda", path, sampled, dtype)
