"""float32 gradients of the parallel cross-entropy, plain and fused, as
accurate as F.cross_entropy's: at most 2x its error against float64 at logit
scales 1 to 1000 (TorchShard's test data reaches 1000, where a log-sum-exp
rounded to float32 alone costs 3e-5 in every exp(x - lse))."""
import pytest
import torch
import torch.nn.functional as F

import shardtorch as ts

SCALES = (1.0, 10.0, 100.0, 1000.0)
ROWS, CLASSES, FEATURES = 64, 1000, 32


def _error(grad: torch.Tensor, reference: torch.Tensor) -> float:
    return (grad.double() - reference).abs().max().item()


def _grad(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    fn(*inputs).backward()
    return [t.grad for t in inputs]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("scale", SCALES)
def test_plain_loss_gradient_as_accurate_as_torch(world_of_one, scale, reduction):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(ROWS, CLASSES, generator=generator) * scale).float()
    target = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    exact, = _grad(lambda x: F.cross_entropy(x, target, reduction=reduction), logits.double())
    torch_error = _error(*_grad(lambda x: F.cross_entropy(x, target, reduction=reduction), logits), exact)
    ours = _grad(lambda x: ts.nn.functional.parallel_cross_entropy(x, target, reduction=reduction, parallel=True),
                 logits)[0]
    assert ours.dtype == torch.float32
    our_error = _error(ours, exact)
    assert our_error <= 2 * torch_error, (scale, reduction, our_error, torch_error)


@pytest.mark.parametrize("scale", SCALES)
def test_fused_loss_gradient_as_accurate_as_torch(world_of_one, scale):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, FEATURES, generator=generator).float()
    # Weights scaled so that the logits reach the scale (|x w| ~ scale).
    weight = (torch.randn(CLASSES, FEATURES, generator=generator) * scale / FEATURES ** 0.5).float()
    bias = torch.randn(CLASSES, generator=generator).float()
    target = torch.randint(0, CLASSES, (ROWS,), generator=generator)

    def plain(x, w, b):
        return F.cross_entropy(F.linear(x, w, b), target)

    def fused(x, w, b):
        return ts.nn.functional.parallel_linear_cross_entropy(x, w, b, target, chunk_size=256)

    exact = _grad(plain, x.double(), weight.double(), bias.double())
    theirs, ours = _grad(plain, x, weight, bias), _grad(fused, x, weight, bias)
    for name, e, t, o in zip(("input", "weight", "bias"), exact, theirs, ours):
        our_error, torch_error = _error(o, e), _error(t, e)
        assert our_error <= 2 * torch_error, (scale, name, our_error, torch_error)
