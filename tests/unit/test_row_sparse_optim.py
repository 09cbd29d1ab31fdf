"""ts.optim.RowSparseSGD / RowSparseAdam in one process.

Dense gradients: the result is torch.optim.SGD's / Adam's bitwise (the same
passes in the same order), in float64 and float32, over several steps.
Row-sparse gradients: each row follows the optimizer's formula written out
below as if it were a parameter of its own that got a gradient only at the
steps it was kept; rows not kept keep their value and state bitwise. The
reference is plain float64 arithmetic, so the comparison allows 1e-12 relative
(the library's kernels fuse multiply-adds and use lerp).
(tests/distributed/cases_margin.py checks them again inside the sampled loss.)"""
import math

import pytest
import torch

import shardtorch as ts

ROWS, COLS = 13, 5

SGD_SETTINGS = {
    "plain": dict(lr=0.1),
    "momentum, weight decay": dict(lr=0.1, momentum=0.9, weight_decay=5e-2),
    "dampening": dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    "nesterov": dict(lr=0.1, momentum=0.8, nesterov=True, weight_decay=1e-2),
    "nesterov, no weight decay": dict(lr=0.1, momentum=0.8, nesterov=True),
}
ADAM_SETTINGS = {
    "plain": dict(lr=0.05),
    "weight decay": dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=1e-2),
}


def _gradients(steps, dtype, seed=0, shape=(ROWS, COLS)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(steps)]


def _run_pair(ours_cls, theirs_cls, settings, dtype, foreach=None, shape=(ROWS, COLS), fused=None):
    start = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    mine, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
    opt_mine = ours_cls([mine], **settings)
    opt_theirs = theirs_cls([theirs], foreach=foreach, fused=fused, **settings)
    for grad in _gradients(4, dtype, shape=shape):
        mine.grad, theirs.grad = grad.clone(), grad.clone()
        opt_mine.step()
        opt_theirs.step()
    return mine, theirs, opt_mine, opt_theirs


# torch's three SGD implementations agree bitwise on the elements their vectorised loops take and
# may differ in the last bit on the rest (a row-major tensor's last numel % vector width elements: the
# scalar tails round a*b + c differently). RowSparseSGD runs torch's fused kernel (one pass) where no
# row has its own step count, and torch's passes where dampening gives each row one.
SGD_IMPLEMENTATIONS = {"fused": dict(fused=True, foreach=False), "foreach": dict(foreach=True),
                       "for-loop": dict(foreach=False)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("impl", list(SGD_IMPLEMENTATIONS))
@pytest.mark.parametrize("name", list(SGD_SETTINGS))
def test_sgd_on_dense_gradients_is_torchs(name, impl, dtype):
    """Bitwise the torch implementation RowSparseSGD runs (fused, or with dampening the passes, which
    foreach and the for-loop share), within 2 ulp of the other."""
    settings = SGD_SETTINGS[name]
    ours_fused = "dampening" not in settings
    mine, theirs, opt_mine, opt_theirs = _run_pair(ts.optim.RowSparseSGD, torch.optim.SGD, settings, dtype,
                                                   **SGD_IMPLEMENTATIONS[impl])
    tensors = [(mine, theirs)]
    if "momentum" in settings:
        tensors.append((opt_mine.state[mine]["momentum_buffer"], opt_theirs.state[theirs]["momentum_buffer"]))
    _assert_torchs(tensors, ours_fused == (impl == "fused"), dtype, 2)


def _assert_torchs(pairs, bitwise, dtype, ulps, of_largest=False):
    """Bitwise, or within `ulps` ulps of each value (of_largest: of the tensor's largest magnitude)."""
    for a, b in pairs:
        if bitwise:
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            size = b.detach().abs()
            ulp = torch.finfo(dtype).eps * (size.max() if of_largest else size).clamp_min(torch.finfo(dtype).tiny)
            assert ((a - b).abs() <= ulps * ulp).all(), ((a - b).abs() / ulp).max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("impl", list(SGD_IMPLEMENTATIONS))
@pytest.mark.parametrize("name", list(ADAM_SETTINGS))
def test_adam_on_dense_gradients_is_torchs(name, impl, dtype):
    """Every row at one step: bitwise torch's fused Adam, which RowSparseAdam runs then; within 4 ulps of
    each tensor's largest value of torch's foreach and for-loop Adam (their passes round differently from
    the fused kernel; a parameter value that the update cancels to near zero keeps its operands' rounding:
    12 ulps of that small value, 0.22 of the tensor's largest, on a Zen 5 EPYC)."""
    mine, theirs, opt_mine, opt_theirs = _run_pair(ts.optim.RowSparseAdam, torch.optim.Adam, ADAM_SETTINGS[name],
                                                   dtype, **SGD_IMPLEMENTATIONS[impl])
    pairs = [(mine, theirs)] + [(opt_mine.state[mine][k], opt_theirs.state[theirs][k])
                                for k in ("exp_avg", "exp_avg_sq")]
    _assert_torchs(pairs, impl == "fused", dtype, 4, of_largest=True)
    assert torch.equal(opt_mine.state[mine]["row_step"], torch.full((ROWS,), 4, dtype=torch.int64))


def test_dense_gradients_at_the_benchmarks_row_width_are_torchs_bitwise():
    # 512 columns: every element on the vectorised path, as in benchmarks/optimizer.py, where torch's
    # SGD implementations agree bitwise (its Adam's do not: fused, as RowSparseAdam runs).
    for ours, theirs, settings, impl in (
            (ts.optim.RowSparseSGD, torch.optim.SGD, SGD_SETTINGS["momentum, weight decay"], dict(foreach=True)),
            (ts.optim.RowSparseAdam, torch.optim.Adam, ADAM_SETTINGS["weight decay"], dict(fused=True, foreach=False))):
        mine, reference, _, _ = _run_pair(ours, theirs, settings, torch.float32, shape=(64, 512), **impl)
        assert torch.equal(mine, reference), ours.__name__


# The formulas of torch.optim.SGD and torch.optim.Adam (their documentation's
# pseudocode), one row at a time, in float64.
def _sgd_row(row, grad, settings):
    lr, momentum = settings["lr"], settings.get("momentum", 0.0)
    dampening, weight_decay = settings.get("dampening", 0.0), settings.get("weight_decay", 0.0)
    d_p = grad + weight_decay * row["param"]
    if momentum:
        if row["steps"] == 0:
            row["buf"] = d_p.clone()
        else:
            row["buf"] = momentum * row["buf"] + (1 - dampening) * d_p
        d_p = d_p + momentum * row["buf"] if settings.get("nesterov") else row["buf"]
    row["param"] = row["param"] - lr * d_p
    row["steps"] += 1


def _adam_row(row, grad, settings):
    lr, (beta1, beta2) = settings["lr"], settings.get("betas", (0.9, 0.999))
    eps, weight_decay = settings.get("eps", 1e-8), settings.get("weight_decay", 0.0)
    row["steps"] += 1
    t = row["steps"]
    grad = grad + weight_decay * row["param"]
    row["m"] = beta1 * row["m"] + (1 - beta1) * grad
    row["v"] = beta2 * row["v"] + (1 - beta2) * grad * grad
    denom = row["v"].sqrt() / math.sqrt(1 - beta2**t) + eps
    row["param"] = row["param"] - lr / (1 - beta1**t) * row["m"] / denom


def _row_sparse_gradient(grad, kept):
    return torch.sparse_coo_tensor(kept.unsqueeze(0), grad[kept], grad.shape).coalesce()


def _kept_sets(steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    sets = []
    for i in range(steps):
        kept = torch.randperm(ROWS, generator=g)[:ROWS // 3].sort().values
        sets.append(None if i == steps - 1 else kept)  # the last step dense: rows at different steps
    return sets


@pytest.mark.parametrize("kind,name", [("sgd", n) for n in SGD_SETTINGS] + [("adam", n) for n in ADAM_SETTINGS])
def test_row_sparse_gradients_follow_the_per_row_formula(kind, name):
    settings = (SGD_SETTINGS if kind == "sgd" else ADAM_SETTINGS)[name]
    opt_cls, row_step = (ts.optim.RowSparseSGD, _sgd_row) if kind == "sgd" else (ts.optim.RowSparseAdam, _adam_row)
    start = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    param = start.clone().requires_grad_()
    opt = opt_cls([param], **settings)
    rows = [dict(param=start[r].clone(), steps=0, buf=None, m=torch.zeros(COLS, dtype=torch.float64),
                 v=torch.zeros(COLS, dtype=torch.float64)) for r in range(ROWS)]
    kept_sets = _kept_sets(6)
    for grad, kept in zip(_gradients(len(kept_sets), torch.float64), kept_sets):
        param.grad = grad.clone() if kept is None else _row_sparse_gradient(grad, kept)
        not_kept = torch.full((ROWS,), kept is not None)
        if kept is not None:
            not_kept[kept] = False
        before = param.detach()[not_kept].clone()
        state_before = {k: v[not_kept].clone() for k, v in opt.state[param].items()}
        opt.step()
        assert torch.equal(param.detach()[not_kept], before), "a row not kept moved"
        for key, values in state_before.items():
            assert torch.equal(opt.state[param][key][not_kept], values), f"{key} of a row not kept changed"
        for r in range(ROWS) if kept is None else kept.tolist():
            row_step(rows[r], grad[r], settings)
        expected = torch.stack([row["param"] for row in rows])
        torch.testing.assert_close(param.detach(), expected, rtol=1e-12, atol=1e-12)
    if "row_step" in opt.state[param]:
        assert opt.state[param]["row_step"].tolist() == [row["steps"] for row in rows]


def test_row_sparse_updates_are_bitwise_torchs_on_each_row_as_its_own_parameter():
    # A row kept at steps 1 and 3 ends where torch's optimizer over that row alone ends after those
    # two steps. SGD: the same kernels on the kept rows. Adam: shard::_row_sparse_adam_, whose
    # element-by-element path (rows of 5 values are shorter than a vector) fuses lerp's multiply-add
    # as torch's kernels do (longer rows: test_row_sparse_adams_op_is_its_passes_within_two_ulps_...).
    # torch's for-loop and fused Adam themselves differ in the last bit of one of these 65 values on
    # a Zen 5 EPYC (not on the Xeons): Adam's result must be one of theirs, bit for bit.
    for opt_cls, torch_cls, settings, impls in (
            (ts.optim.RowSparseSGD, torch.optim.SGD, SGD_SETTINGS["dampening"], [dict(foreach=False)]),
            (ts.optim.RowSparseAdam, torch.optim.Adam, ADAM_SETTINGS["weight decay"],
             [dict(foreach=False), dict(fused=True)])):
        start = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
        param = start.clone().requires_grad_()
        opt = opt_cls([param], **settings)
        singles = {i: [start[r].clone().requires_grad_() for r in range(ROWS)] for i in range(len(impls))}
        single_opts = {i: [torch_cls([s], **impls[i], **settings) for s in singles[i]] for i in singles}
        for grad, kept in zip(_gradients(3, torch.float32), _kept_sets(4)[:3]):
            param.grad = _row_sparse_gradient(grad, kept)
            opt.step()
            for i in singles:
                for r in kept.tolist():
                    singles[i][r].grad = grad[r].clone()
                    single_opts[i][r].step()
        references = [torch.stack([s.detach() for s in singles[i]]) for i in singles]
        assert any(torch.equal(param.detach(), reference) for reference in references), opt_cls.__name__


def test_uncoalesced_gradients_add_their_duplicate_rows():
    param = torch.zeros(4, 2, dtype=torch.float64, requires_grad=True)
    opt = ts.optim.RowSparseSGD([param], lr=1.0)
    indices = torch.tensor([[2, 0, 2]])
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    param.grad = torch.sparse_coo_tensor(indices, values, (4, 2))
    opt.step()
    assert param.detach().tolist() == [[-3.0, -4.0], [0.0, 0.0], [-6.0, -8.0], [0.0, 0.0]]


def test_row_sparse_scratch_is_reused_and_sized_by_the_kept_rows():
    # Scratch is for the passes: RowSparseSGD with dampening (per-row steps) gathers the kept rows into
    # two [kept, row] buffers; RowSparseAdam's op updates them in place and holds none.
    param = torch.zeros(1000, 8, requires_grad=True)
    adam_param = torch.zeros(1000, 8, requires_grad=True)
    opt = ts.optim.RowSparseSGD([param], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1)
    adam = ts.optim.RowSparseAdam([adam_param], lr=0.1, weight_decay=0.1)
    for kept_count in (100, 50, 100):
        kept = torch.arange(kept_count) * 3
        param.grad = adam_param.grad = _row_sparse_gradient(torch.ones(1000, 8), kept)
        opt.step()
        adam.step()
    assert opt.scratch_bytes == 2 * 100 * 8 * 4  # two [kept, row] float32 buffers, never regrown
    assert adam.scratch_bytes == 0


class _AdamInPasses(ts.optim.RowSparseAdam):
    """RowSparseAdam with the kept rows updated by its ATen passes (what DTensor parameters take)
    instead of shard::_row_sparse_adam_."""

    def _update_rows(self, group, param, rows, grad, state):
        self._update_rows_in_passes(group, param, rows, grad, state)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cols", [5, 37, 512])
def test_row_sparse_adams_op_is_its_passes_within_two_ulps_of_the_largest_value(cols, dtype):
    """The op (one pass per kept row) against the passes it replaced, six row-sparse steps with rows at
    different step counts: the steps bitwise; each value within 2 ulps of its tensor's largest magnitude
    (eps * max|x|). Not bitwise: the op rounds lerp's and addcmul's multiply-adds as this build's
    vectorised code does, torch's kernels fuse some of them; near-cancelling moments then differ
    by many of their own ulps but not of the tensor's scale (measured: at most 1 such ulp)."""
    g = torch.Generator().manual_seed(0)
    rows = 300
    start = torch.randn(rows, cols, generator=g, dtype=dtype)
    mine, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
    settings = ADAM_SETTINGS["weight decay"]
    opt_mine, opt_theirs = ts.optim.RowSparseAdam([mine], **settings), _AdamInPasses([theirs], **settings)
    for _ in range(6):
        kept = torch.randperm(rows, generator=g)[:rows // 3].sort().values
        grad = _row_sparse_gradient(torch.randn(rows, cols, generator=g, dtype=dtype), kept)
        mine.grad, theirs.grad = grad.clone(), grad.clone()
        opt_mine.step()
        opt_theirs.step()
    assert torch.equal(opt_mine.state[mine]["row_step"], opt_theirs.state[theirs]["row_step"])
    assert opt_mine.state[mine]["row_step"].unique().numel() > 2
    pairs = [(mine.detach(), theirs.detach())] + [(opt_mine.state[mine][k], opt_theirs.state[theirs][k])
                                                  for k in ("exp_avg", "exp_avg_sq")]
    for a, b in pairs:
        scale_ulp = torch.finfo(dtype).eps * b.abs().max()
        assert ((a - b).abs() <= 2 * scale_ulp).all(), ((a - b).abs().max() / scale_ulp)
    assert not torch.equal(mine.detach(), start)


def test_a_gradient_sparse_in_two_dims_is_refused():
    param = torch.zeros(3, 3, requires_grad=True)
    param.grad = torch.eye(3).to_sparse()
    with pytest.raises(ValueError, match=r"RowSparseSGD: a sparse gradient must be row-sparse \(sparse_dim 1\), "
                                         r"got sparse_dim 2"):
        ts.optim.RowSparseSGD([param], lr=0.1).step()


def test_a_sparse_gradient_not_marked_coalesced_is_read_as_torch_sums_it():
    """autograd's accumulation drops a sparse gradient's coalesced mark; the optimizer then reads
    strictly increasing rows as they are and coalesces anything else (unsorted or repeated rows are
    summed). The same update for the marked gradient, the same rows unmarked, and the rows repeated
    out of order with halves of the values (exact in binary)."""
    g = torch.Generator().manual_seed(3)
    start = torch.randn(ROWS, COLS, generator=g)
    rows = torch.tensor([1, 4, 5, 11])
    values = torch.randn(4, COLS, generator=g)
    marked = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (ROWS, COLS)).coalesce()
    unmarked = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (ROWS, COLS))
    order = torch.tensor([3, 0, 2, 1, 0, 3, 1, 2])
    repeated = torch.sparse_coo_tensor(rows[order].unsqueeze(0), values[order] / 2, (ROWS, COLS))
    assert marked.is_coalesced() and not unmarked.is_coalesced() and not repeated.is_coalesced()
    results = []
    for grad in (marked, unmarked, repeated):
        for cls, settings in ((ts.optim.RowSparseSGD, SGD_SETTINGS["momentum, weight decay"]),
                              (ts.optim.RowSparseAdam, ADAM_SETTINGS["weight decay"])):
            p = start.clone().requires_grad_()
            opt = cls([p], **settings)
            for _ in range(2):
                p.grad = grad.clone()
                opt.step()
            results.append(p.detach())
    for i in range(2, len(results)):
        assert torch.equal(results[i], results[i % 2]), i
    changed = (results[0] != start).any(1)
    assert torch.equal(changed.nonzero().flatten(), rows)


@pytest.mark.parametrize("ours,theirs,settings", [
    (ts.optim.RowSparseSGD, torch.optim.SGD, SGD_SETTINGS["momentum, weight decay"]),
    (ts.optim.RowSparseAdam, torch.optim.Adam, ADAM_SETTINGS["weight decay"]),
])
def test_dtensor_parameters_as_fully_shard_makes_them_update_like_plain_ones(world_of_one, ours, theirs, settings):
    """fully_shard (FSDP2) hands the optimizer DTensor parameters and gradients, for which torch's fused
    kernels have no sharding rule: the optimizers take their passes there, and the result is the plain
    tensor's under torch's own optimizer (same passes: bitwise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(5)
    start = torch.randn(ROWS, COLS, generator=g)
    mine = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(0)]))
    reference = torch.nn.Parameter(start.clone())
    opt_mine, opt_ref = ours([mine], **settings), theirs([reference], foreach=True, **settings)
    for grad in _gradients(3, torch.float32):
        mine.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        reference.grad = grad.clone()
        opt_mine.step()
        opt_ref.step()
    assert torch.equal(mine.full_tensor(), reference.detach())
