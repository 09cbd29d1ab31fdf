"""shard::_row_sparse_adam_ (csrc/ops/row_sparse_adam.h), RowSparseAdam's kernel for a row-sparse
gradient, against torch.optim.Adam's update written out per row in float64 with each row's own step
count, over several steps in which different rows are given: the rows given move as that formula says
and advance their step, every other row (value, moments, step) and the gradient stay bitwise, and bad
arguments fail by name. Also the Meta kernels of it and of shard::_row_sparse_sgd_ (FakeTensor)."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import shardtorch  # noqa: F401 (registers the shard ops)

OP = torch.ops.shard._row_sparse_adam_
SETTINGS = {  # (lr, beta1, beta2, eps, weight_decay)
    "plain": (0.05, 0.9, 0.999, 1e-8, 0.0),
    "weight decay": (0.05, 0.8, 0.95, 1e-6, 1e-2),
    "beta1 above one half": (0.01, 0.3, 0.99, 1e-8, 5e-4),  # lerp's other branch
}
ROWS = 40
# Rows given at each step: the first and the last row, neighbours, rows given once, twice, thrice.
ROW_SETS = ([0, 3, 4, 17, 39], [3, 5, 17, 38], [0, 4, 5, 21, 39])


def expected_rows(param, exp_avg, exp_avg_sq, steps, grad, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.Adam's single-tensor step on the given rows in float64, each row at its own step
    (`steps`, before the step)."""
    p, m, v, g = param.double(), exp_avg.double(), exp_avg_sq.double(), grad.double()
    g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    new_p = torch.empty_like(p)
    for i, step in enumerate((steps + 1).tolist()):
        step_size = lr / (1 - beta1**step)
        denom = v[i].sqrt() / math.sqrt(1 - beta2**step) + eps
        new_p[i] = p[i] - step_size * m[i] / denom
    return new_p, m, v


def composite(*args):
    """The any-device kernel (gathered rows, ATen arithmetic: what CUDA runs) called on CPU tensors."""
    torch.ops.shard._row_sparse_adam_.default._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args)


def device_case(device, dtype, name, columns, seed=0, op=OP):
    settings = SETTINGS[name]
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(ROWS, columns, generator=g).to(dtype)
    exp_avg = (torch.randn(ROWS, columns, generator=g) * 0.1).to(dtype)
    exp_avg_sq = (torch.rand(ROWS, columns, generator=g) * 0.01).to(dtype)
    row_step = torch.randint(0, 5, (ROWS,), generator=g)  # rows at different steps
    on = [t.to(device) for t in (param, exp_avg, exp_avg_sq, row_step)]
    # Each stored value is the float64 formula of the stored inputs, rounded (a few roundings on the way).
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    for row_set in ROW_SETS:
        rows = torch.tensor(row_set)
        grad = torch.randn(len(rows), columns, generator=g).to(dtype)
        before = [t.cpu().clone() for t in on]
        want = expected_rows(*(t[rows] for t in before), grad, *settings)
        grad_on = grad.to(device)
        op(*on, rows.to(device), grad_on, *settings)
        after = [t.cpu() for t in on]
        for got, expected in zip(after[:3], want):
            torch.testing.assert_close(got[rows].double(), expected, rtol=tol, atol=tol)
        assert torch.equal(after[3][rows], before[3][rows] + 1)
        others = torch.ones(ROWS, dtype=torch.bool)
        others[rows] = False
        for got, old in zip(after, before):
            assert torch.equal(got[others], old[others])
        assert torch.equal(grad_on.cpu(), grad)


# 37 columns: the vectorised loop and the element-by-element tail; 512: the benchmarks' rows.
@pytest.mark.parametrize("columns", [37, 512])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_rows_given_follow_adam_at_their_own_steps_and_nothing_else_moves(name, dtype, columns):
    device_case("cpu", dtype, name, columns)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_any_device_kernel_follows_adam_on_cpu_tensors(name, dtype):
    device_case("cpu", dtype, name, 37, op=composite)


def _arguments(rows=(0, 2), grad_shape=(2, 3), **replace):
    args = dict(param=torch.randn(4, 3), exp_avg=torch.zeros(4, 3), exp_avg_sq=torch.zeros(4, 3),
                row_step=torch.zeros(4, dtype=torch.int64),
                rows=rows if torch.is_tensor(rows) else torch.tensor(rows, dtype=torch.int64),
                grad=torch.randn(grad_shape))
    args.update(replace)
    return args


def test_no_rows_is_a_no_op():
    args = _arguments(rows=[], grad_shape=(0, 3))
    before = {k: v.clone() for k, v in args.items()}
    OP(**args, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    for key, value in args.items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("replace,match", [
    (dict(rows=torch.tensor([2, 1])), "rows must be strictly increasing indices in \\[0, 4\\), got 1 at position 1 "
                                      "after 2"),
    (dict(rows=torch.tensor([1, 1])), "strictly increasing"),
    (dict(rows=torch.tensor([0, 4])), "got 4 at position 1"),
    (dict(rows=torch.tensor([-1, 0])), "got -1 at position 0"),
    (dict(rows=torch.tensor([0, 1], dtype=torch.int32)), "rows must be a 1-D int64 tensor, got Int"),
    (dict(grad=torch.randn(3, 3)), "grad must be contiguous \\[len\\(rows\\), param.size\\(1\\)\\] = \\[2, 3\\] in "
                                   "param's dtype Float, got Float of shape \\[3, 3\\]"),
    (dict(grad=torch.randn(2, 3, dtype=torch.float64)), "grad must be .* got Double"),
    (dict(exp_avg=torch.zeros(4, 2)), "exp_avg must be contiguous, shaped and typed like param \\[4, 3\\] Float, "
                                      "got \\[4, 2\\] Float"),
    (dict(exp_avg_sq=torch.zeros(4, 3, dtype=torch.float64)), "exp_avg_sq must be .* got \\[4, 3\\] Double"),
    (dict(row_step=torch.zeros(4)), "row_step must be a contiguous int64 \\[param.size\\(0\\)\\] = \\[4\\] tensor, "
                                    "got Float of shape \\[4\\]"),
    (dict(row_step=torch.zeros(3, dtype=torch.int64)), "row_step must .* got Long of shape \\[3\\]"),
    (dict(param=torch.randn(3, 4).t()), "param must be a contiguous \\[rows, columns\\] tensor"),
    (dict(row_step=torch.zeros(4, dtype=torch.int64, device="meta")), "row_step must be on param's device cpu, "
                                                                      "got meta"),
])
def test_bad_arguments_fail_by_name(replace, match):
    args = _arguments(**replace)
    before = {k: v.clone() for k, v in args.items() if v.device.type == "cpu"}
    with pytest.raises(RuntimeError, match="shard::_row_sparse_adam_: .*" + match):
        OP(**args, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    for key, value in before.items():  # checked before anything is written
        assert torch.equal(args[key], value), key


# Meta kernels: FakeTensor (torch.compile's tracing) and the meta device run the checks, write nothing.
def _sgd_arguments(device, columns=3):
    return (torch.randn(4, 3, device=device), torch.zeros(4, 3, device=device),
            torch.tensor([0, 2], device=device), torch.randn(2, columns, device=device), 0.1, 0.9, 0.0, False)


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_meta_kernels_take_the_meta_device_and_fake_tensors(op):
    def call(device_args):
        if op == "adam":
            OP(*device_args, 0.1, 0.9, 0.999, 1e-8, 0.0)
        else:
            torch.ops.shard._row_sparse_sgd_(*device_args)

    adam_args = list(_arguments().values())
    real = adam_args if op == "adam" else list(_sgd_arguments("cpu"))
    tensors = [a for a in real if torch.is_tensor(a)]
    scalars = [a for a in real if not torch.is_tensor(a)]
    call([t.to("meta") for t in tensors] + scalars)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in tensors]
        call(fakes + scalars)
        assert all(f.shape == t.shape for f, t in zip(fakes, tensors))


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_meta_kernels_refuse_bad_shapes_by_name(op):
    if op == "adam":
        args = [t.to("meta") for t in _arguments(grad_shape=(2, 5)).values()]
        with pytest.raises(RuntimeError, match="shard::_row_sparse_adam_: grad must be contiguous"):
            OP(*args, 0.1, 0.9, 0.999, 1e-8, 0.0)
    else:
        args = _sgd_arguments("meta", columns=5)
        with pytest.raises(RuntimeError, match="shard::_row_sparse_sgd_: grad must be contiguous"):
            torch.ops.shard._row_sparse_sgd_(*args)


def test_overlapping_tensors_are_refused():
    args = _arguments()
    args["exp_avg_sq"] = args["exp_avg"]
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        OP(**args, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
