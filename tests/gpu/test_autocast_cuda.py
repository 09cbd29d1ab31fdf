"""The fused heads under torch.autocast("cuda"): their GEMMs in float16/bfloat16 (cuBLASLt with
float32 output for the linear head, ATen's for the margin head), everything else in float32, the
gradients still computed in forward; the same checks as tests/ops/test_autocast.py runs on the CPU.
Skipped where no GPU is present."""
import pytest
import torch

from tests.ops.test_autocast import (REDUCTIONS, SHAPES, check_linear_cross_entropy_every_reduction,
                                     check_linear_cross_entropy_under_autocast,
                                     check_margin_loss_every_reduction, check_margin_loss_under_autocast)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_cross_entropy_under_cuda_autocast(cuda_world_of_one, shape, dtype):
    check_linear_cross_entropy_under_autocast("cuda", dtype, shape)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_margin_loss_under_cuda_autocast(cuda_world_of_one, shape, dtype, sampled):
    check_margin_loss_under_autocast("cuda", dtype, shape, sampled)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_every_reduction_under_cuda_autocast(cuda_world_of_one, reduction, dtype):
    check_linear_cross_entropy_every_reduction("cuda", dtype, reduction)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_margin_loss_every_reduction_under_cuda_autocast(cuda_world_of_one, reduction, dtype, sampled):
    check_margin_loss_every_reduction("cuda", dtype, reduction, sampled)
