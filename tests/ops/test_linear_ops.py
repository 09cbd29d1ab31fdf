"""The ops of the foundation (parallel_linear and the mappings) in one process:
torch.library.opcheck, gradcheck in float64, TorchScript and torch.compile."""
import pytest
import torch

import shardtorch as ts

OPS = torch.ops.shard


def _linear_args(dim, bias, batch=(3,), dtype=torch.float64, requires_grad=True):
    torch.manual_seed(0)
    x = torch.randn(*batch, 5, dtype=dtype, requires_grad=requires_grad)
    w = torch.randn(4, 5, dtype=dtype, requires_grad=requires_grad)
    b = torch.randn(4, dtype=dtype, requires_grad=requires_grad) if bias else None
    return x, w, b, dim, "tp"


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [(3,), (2, 3), ()])
def test_parallel_linear_opcheck(dim, bias, batch):
    torch.library.opcheck(OPS.parallel_linear.default, _linear_args(dim, bias, batch))


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_parallel_linear_backward_opcheck(dim):
    x, w, b, _, group = _linear_args(dim, True, requires_grad=False)
    grad = torch.randn(3, 4, dtype=torch.float64)
    torch.library.opcheck(OPS._parallel_linear_backward.default, (grad, x, w, dim, group, [True, True, True]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_parallel_linear_gradcheck(dim, bias):
    x, w, b, _, group = _linear_args(dim, bias)
    inputs = (x, w) + ((b,) if bias else ())
    assert torch.autograd.gradcheck(
        lambda x, w, *b: OPS.parallel_linear(x, w, b[0] if b else None, dim, group), inputs)


def test_parallel_linear_matches_torch_linear():
    x, w, b, _, group = _linear_args(1, True, batch=(2, 3))
    torch.testing.assert_close(OPS.parallel_linear(x, w, b, 1, group), torch.nn.functional.linear(x, w, b),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op,args", [
    ("copy", lambda x: (x, "tp")),
    ("reduce", lambda x: (x, "tp")),
    ("scatter", lambda x: (x, 1, "tp")),
    ("gather_replicated", lambda x: (x, -1, "tp", None)),
    ("gather_replicated", lambda x: (x, 0, "tp", 3)),
    ("all_gather", lambda x: (x, 1, "tp", 4)),
    ("reduce_scatter", lambda x: (x, 0, "tp")),
])
def test_mapping_opcheck_and_gradcheck(op, args):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(getattr(OPS, op).default, args(x))
    assert torch.autograd.gradcheck(lambda t: getattr(OPS, op)(*args(t)), (x,))
    # On one rank every mapping is the identity.
    torch.testing.assert_close(getattr(OPS, op)(*args(x)), x)


def test_the_old_gather_alias_is_gone():
    """shard::gather (the pre-release name of gather_replicated) was removed
    before the first release: only the two names that say their backward remain."""
    assert not hasattr(OPS, "gather")
    assert hasattr(OPS, "gather_replicated") and hasattr(OPS, "all_gather")


def test_double_backward_of_mappings():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: OPS.all_gather(t * t, 1, "tp", None), (x,))


def test_backward_op_refuses_double_backward():
    x, w, b, _, group = _linear_args(1, True)
    y = OPS.parallel_linear(x, w, b, 1, group)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


def test_scripted_function_and_module():
    @torch.jit.script
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ops.shard.parallel_linear(x, w, b, 1, "tp")

    x, w, b, _, _ = _linear_args(1, True)
    y = f(x, w, b)
    y.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(3, 4, dtype=torch.float64).t() @ x.detach())
    layer = ts.nn.ParallelLinear(5, 4, dim=1, dtype=torch.float64)
    scripted = torch.jit.script(layer)
    torch.testing.assert_close(scripted(x.detach()), layer(x.detach()))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(ts.nn.ParallelLinear(5, 6, dim=1), torch.nn.ReLU(),
                                ts.nn.ParallelLinear(6, 3, dim=0))
    x = torch.randn(4, 5)
    expected = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    out = compiled(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
