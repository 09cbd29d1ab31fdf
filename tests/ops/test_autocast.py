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
