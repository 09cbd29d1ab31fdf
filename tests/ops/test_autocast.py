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
