"""Probability (soft) targets of the parallel cross-entropy on CUDA (the CUDA
kernels plus the ATen probability passes, NCCL in a world-1 group) against
F.cross_entropy in float64; skipped where no GPU is present."""
import pytest
import torch

import shardtorch as ts
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


def test_a_million_local_classes_go_by_many_rows_a_block():
    """On CUDA the probability passes take 2^26 values a block: 64 rows of a million classes, so 130
    rows make three blocks, the last one short (one row a block would be thousands of launches)."""
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
