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
