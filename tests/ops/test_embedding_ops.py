"""The embedding ops in one process (a world-1 group, where a shard is the
whole table): torch.library.opcheck, and results and gradients against
torch.nn.functional.embedding in float64."""
import pytest
import torch
import torch.nn.functional as F

OPS = torch.ops.shard
ROWS, COLUMNS = 7, 5


def _args(dim, padding_idx=None, scale_grad_by_freq=False, sparse=False, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(ROWS, COLUMNS, dtype=torch.float64, generator=g).requires_grad_(requires_grad)
    indices = torch.tensor([[0, 3, 3], [6, 2, 0]])
    full_size = ROWS if dim == 0 else COLUMNS
    return indices, weight, padding_idx, dim, full_size, scale_grad_by_freq, sparse, "tp"


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_parallel_embedding_opcheck(dim, padding_idx, scale_grad_by_freq):
    torch.library.opcheck(OPS.parallel_embedding.default, _args(dim, padding_idx, scale_grad_by_freq))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_parallel_embedding_matches_torch_float64(dim, padding_idx, scale_grad_by_freq):
    indices, weight, *rest = _args(dim, padding_idx, scale_grad_by_freq)
    reference = weight.detach().clone().requires_grad_()
    upstream = torch.randn(*indices.shape, COLUMNS, dtype=torch.float64)
    out = OPS.parallel_embedding(indices, weight, *rest)
    expected = F.embedding(indices, reference, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(weight.grad, reference.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [0, 1])
def test_parallel_embedding_renorm_opcheck_and_matches_torch(dim):
    indices, weight, _, _, full_size, *_ = _args(dim, requires_grad=False)
    torch.library.opcheck(OPS.parallel_embedding_renorm_.default,
                          (weight.clone(), indices, 1.0, 2.0, dim, full_size, "tp"))
    renormed = OPS.parallel_embedding_renorm_(weight.clone(), indices, 1.0, 2.0, dim, full_size, "tp")
    expected = weight.clone()
    F.embedding(indices, expected, max_norm=1.0, norm_type=2.0)  # renormalises the rows it looks up, in place
    torch.testing.assert_close(renormed, expected, rtol=1e-12, atol=1e-12)
