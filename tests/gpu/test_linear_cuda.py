"""parallel_linear on CUDA (cuBLASLt GEMMs, fused bias) and the NCCL
communicator, against torch's own CUDA linear in float64 and lower precisions."""
import pytest
import torch

from tests.gpu.conftest import requires_cuda

pytestmark = requires_cuda
OPS = torch.ops.shard


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [(7,), (3, 5), (0,)])
def test_parallel_linear_cuda_matches_reference(cuda_world_of_one, dtype, dim, bias, batch):
    torch.manual_seed(0)
    x = torch.randn(*batch, 33, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(17, 33, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(17, device="cuda", dtype=dtype, requires_grad=True) if bias else None
    y = OPS.parallel_linear(x, w, b, dim, "tp")
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    y64 = torch.nn.functional.linear(x64, w64, b64)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
    g = torch.randn_like(y64)
    y.backward(g.to(dtype))
    y64.backward(g)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=tol * 4, atol=tol * 4)
    if bias:
        torch.testing.assert_close(b.grad.double(), b64.grad, rtol=tol * 4, atol=tol * 4)


def test_opcheck_cuda(cuda_world_of_one):
    x = torch.randn(4, 8, device="cuda", dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 8, device="cuda", dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, device="cuda", dtype=torch.float64, requires_grad=True)
    for dim in (None, 0, 1):
        torch.library.opcheck(OPS.parallel_linear.default, (x, w, b, dim, "tp"))


@pytest.mark.parametrize("op,args", [("reduce", lambda t: (t, "tp")), ("all_gather", lambda t: (t, 0, "tp", None)),
                                     ("reduce_scatter", lambda t: (t, 1, "tp"))])
def test_nccl_mappings_on_one_rank_are_identity(cuda_world_of_one, op, args):
    x = torch.randn(6, 4, device="cuda")
    torch.testing.assert_close(getattr(OPS, op)(*args(x)), x)


@pytest.mark.tooling
def test_compile_cuda(cuda_world_of_one):
    import shardtorch as ts
    torch.manual_seed(0)
    model = torch.nn.Sequential(ts.nn.ParallelLinear(16, 32, dim=1, device="cuda"), torch.nn.GELU(),
                                ts.nn.ParallelLinear(32, 8, dim=0, device="cuda"))
    x = torch.randn(4, 16, device="cuda")
    expected = model(x)
    out = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(out, expected)
