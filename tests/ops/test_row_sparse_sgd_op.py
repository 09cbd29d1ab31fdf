"""shard::_row_sparse_sgd_ (csrc/ops/row_sparse_sgd.h), RowSparseSGD's kernel for a row-sparse
gradient, against torch.optim.SGD's update written out per row in float64: the rows given move as that
formula says, every other row and the gradient stay bitwise, and bad arguments fail by name."""
import pytest
import torch

import shardtorch  # noqa: F401 (registers the shard ops)

OP = torch.ops.shard._row_sparse_sgd_
SETTINGS = {  # (lr, momentum, weight_decay, nesterov)
    "plain": (0.1, 0.0, 0.0, False),
    "weight decay": (0.1, 0.0, 5e-2, False),
    "momentum": (0.05, 0.9, 0.0, False),
    "momentum, weight decay": (0.05, 0.9, 5e-4, False),
    "nesterov": (0.05, 0.8, 1e-2, True),
}


def expected_rows(param, buf, grad, lr, momentum, weight_decay, nesterov):
    """torch.optim.SGD's step (no dampening, the buffer already started) on the given rows, in float64."""
    p, g = param.double(), grad.double()
    d = g + weight_decay * p
    new_buf = None
    if momentum != 0:
        new_buf = momentum * buf.double() + d
        d = d + momentum * new_buf if nesterov else new_buf
    return p - lr * d, new_buf


def device_case(device, dtype, name, columns, seed=0):
    lr, momentum, weight_decay, nesterov = SETTINGS[name]
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(40, columns, generator=g).to(dtype)
    buf = torch.randn(40, columns, generator=g).to(dtype) if momentum else None
    rows = torch.tensor([0, 3, 4, 17, 39])
    grad = torch.randn(len(rows), columns, generator=g).to(dtype)
    want_p, want_buf = expected_rows(param[rows], None if buf is None else buf[rows], grad, lr, momentum,
                                     weight_decay, nesterov)
    before_p, before_buf, before_grad = param.clone(), None if buf is None else buf.clone(), grad.clone()
    on = [t if t is None else t.to(device) for t in (param, buf, rows, grad)]
    OP(*on, lr, momentum, weight_decay, nesterov)
    param, buf, grad = on[0].cpu(), None if buf is None else on[1].cpu(), on[3].cpu()
    # Each stored value is the float64 formula of the stored inputs, rounded (a few roundings on the way).
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(param[rows].double(), want_p, rtol=tol, atol=tol)
    if buf is not None:
        torch.testing.assert_close(buf[rows].double(), want_buf, rtol=tol, atol=tol)
    others = torch.ones(40, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(param[others], before_p[others])
    if buf is not None:
        assert torch.equal(buf[others], before_buf[others])
    assert torch.equal(grad, before_grad)


# 37 columns: the vectorised loop and the element-by-element tail; 512: the benchmarks' rows.
@pytest.mark.parametrize("columns", [37, 512])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_rows_given_follow_sgd_and_nothing_else_moves(name, dtype, columns):
    device_case("cpu", dtype, name, columns)


def test_no_rows_is_a_no_op():
    param, buf = torch.randn(4, 3), torch.randn(4, 3)
    before = param.clone(), buf.clone()
    OP(param, buf, torch.empty(0, dtype=torch.int64), torch.empty(0, 3), 0.1, 0.9, 0.0, False)
    assert torch.equal(param, before[0]) and torch.equal(buf, before[1])


@pytest.mark.parametrize("rows,grad_shape,buffer,match", [
    ([2, 1], (2, 3), True, "strictly increasing indices in \\[0, 4\\), got 1 at position 1 after 2"),
    ([1, 1], (2, 3), True, "strictly increasing"),
    ([0, 4], (2, 3), True, "got 4 at position 1"),
    ([-1], (1, 3), True, "got -1 at position 0"),
    ([0, 1], (3, 3), True, "grad must be contiguous \\[len\\(rows\\), param.size\\(1\\)\\] = \\[2, 3\\]"),
    ([0, 1], (2, 3), False, "momentum_buffer must be given exactly when momentum != 0, got momentum 0.9 without"),
])
def test_bad_arguments_fail_by_name(rows, grad_shape, buffer, match):
    param = torch.randn(4, 3)
    buf = torch.zeros(4, 3) if buffer else None
    with pytest.raises(RuntimeError, match="shard::_row_sparse_sgd_: .*" + match):
        OP(param, buf, torch.tensor(rows, dtype=torch.int64), torch.randn(grad_shape), 0.1, 0.9, 0.0, False)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="torch's fused SGD kernel fuses its multiply-adds only in its AVX2 / AVX-512 builds")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_rows_given_get_the_bits_of_torchs_fused_sgd(name, dtype):
    """The kept rows end bit for bit where torch's fused SGD kernel (what RowSparseSGD runs on a dense
    gradient) takes the same rows gathered: a row's result does not depend on whether the gradient was
    dense or row-sparse. 512 columns: every element on torch's vector loop (its scalar tail rounds a
    multiply-add differently)."""
    lr, momentum, weight_decay, nesterov = SETTINGS[name]
    g = torch.Generator().manual_seed(7)
    param = torch.randn(300, 512, generator=g, dtype=dtype)
    buf = torch.randn(300, 512, generator=g, dtype=dtype) if momentum else None
    rows = torch.randperm(300, generator=g)[:40].sort().values
    grad = torch.randn(40, 512, generator=g, dtype=dtype)
    taken = param[rows].clone()
    buffers = [buf[rows].clone()] if momentum else []
    torch._fused_sgd_([taken], [grad.clone()], buffers, weight_decay=weight_decay, momentum=momentum, lr=lr,
                      dampening=0.0, nesterov=nesterov, maximize=False, is_first_step=False)
    OP(param, buf, rows, grad, lr, momentum, weight_decay, nesterov)
    assert torch.equal(param[rows], taken)
    if momentum:
        assert torch.equal(buf[rows], buffers[0])


def test_overlapping_tensors_are_refused():
    param = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        OP(param, param, torch.tensor([0, 1]), torch.randn(2, 3), 0.1, 0.9, 0.0, False)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        OP(param, torch.zeros(4, 3), torch.tensor([0, 1]), param[:2], 0.1, 0.9, 0.0, False)
