"""ParallelLinear and the mappings on real ranks, against unsharded torch.

Every case runs on every rank of a harness launch; inputs and reference are
built identically on all ranks from fixed seeds."""
import itertools

import torch
import torch.distributed as dist
from torch import nn

import shardtorch as ts
from shardtorch.nn import init as ts_init
from tests.reference import assert_close, expect_error, shard_of, split_range

GROUP_SIZE = lambda: ts.distributed.get_group_size()  # noqa: E731


def _reference_and_sharded(in_f, out_f, bias, dim, dtype, seed=1234):
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    torch.manual_seed(seed)
    layer = ts.nn.ParallelLinear(in_f, out_f, bias=bias, dim=dim, dtype=dtype)
    return ref, layer


def _check_layer(in_f, out_f, bias, dim, dtype, batch_shape, whole_input=True):
    ref, layer = _reference_and_sharded(in_f, out_f, bias, dim, dtype)
    ref64 = nn.Linear(in_f, out_f, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        ref64.weight.copy_(ref.weight)
        if bias:
            ref64.bias.copy_(ref.bias)
    torch.manual_seed(99)
    x_full = torch.randn(*batch_shape, in_f, dtype=dtype)
    upstream = torch.randn(*batch_shape, out_f, dtype=torch.float64)

    x_ref = x_full.detach().clone().double().requires_grad_()
    y_ref = ref64(x_ref)
    (y_ref * upstream).sum().backward()

    x = x_full.clone().requires_grad_()
    layer_input = x
    if dim == 0 and not whole_input:
        layer_input = ts.distributed.scatter(x, -1)
    y = layer(layer_input)
    if dim in (1, -1):
        assert ts.utils.get_parallel_dim(y) == -1, "column output not marked"
        assert ts.utils.get_parallel_full_size(y) == out_f, "column output does not carry out_features"
        y_whole = ts.distributed.gather_replicated(y, -1, full_size=out_f)
    else:
        y_whole = y
    what = f"in={in_f} out={out_f} bias={bias} dim={dim} {dtype} batch={batch_shape} whole={whole_input}"
    assert_close(y_whole, y_ref, dtype, "forward " + what)
    (y_whole * upstream.to(dtype)).sum().backward()
    assert_close(x.grad, x_ref.grad, dtype, "grad input " + what)
    w_grad = ref64.weight.grad
    if dim in (1, -1):
        w_grad = shard_of(w_grad, 0)
    elif dim == 0:
        w_grad = shard_of(w_grad, 1)
    assert_close(layer.weight.grad, w_grad, dtype, "grad weight " + what)
    if bias:
        b_grad = shard_of(ref64.bias.grad, 0) if dim in (1, -1) else ref64.bias.grad
        assert_close(layer.bias.grad, b_grad, dtype, "grad bias " + what)


def case_layer_matches_nn_linear_float64():
    size = GROUP_SIZE()
    for dim, bias, batch, (in_f, out_f) in itertools.product(
            (None, 0, 1, -1), (True, False), ((5,), (2, 3)), ((4 * size, 2 * size), (4 * size + 1, 2 * size + 3))):
        for whole in ((True, False) if dim == 0 else (True,)):
            _check_layer(in_f, out_f, bias, dim, torch.float64, batch, whole)


def case_layer_matches_nn_linear_float32():
    size = GROUP_SIZE()
    for dim, bias in itertools.product((None, 0, 1), (True, False)):
        _check_layer(16 * size + 3, 8 * size + 1, bias, dim, torch.float32, (2, 7))


def case_more_ranks_than_features():
    # Some ranks hold empty shards; results must still be exact.
    size = GROUP_SIZE()
    if size < 2:
        return
    for dim in (0, 1):
        _check_layer(size - 1, size - 1, True, dim, torch.float64, (3,))


def case_init_equals_nn_linear_bitwise():
    for dtype, dim, (in_f, out_f) in itertools.product(
            (torch.float32, torch.float64, torch.bfloat16), (None, 0, 1), ((7, 13), (33, 5))):
        ref, layer = _reference_and_sharded(in_f, out_f, True, dim, dtype, seed=7)
        (o0, o1), (i0, i1) = layer._out_range, layer._in_range
        assert torch.equal(layer.weight, ref.weight[o0:o1, i0:i1]), (dtype, dim)
        assert torch.equal(layer.bias, ref.bias if dim == 0 else ref.bias[o0:o1]), (dtype, dim)
        # The generator ends where nn.Linear leaves it.
        torch.manual_seed(7)
        nn.Linear(in_f, out_f, dtype=dtype)
        expected_next = torch.rand(3)
        torch.manual_seed(7)
        ts.nn.ParallelLinear(in_f, out_f, dim=dim, dtype=dtype)
        assert torch.equal(torch.rand(3), expected_next)


def case_init_chunked_large():
    # Many chunks (and a real-size one) must still give the exact slice.
    saved = ts_init.CHUNK_ELEMENTS
    try:
        ts_init.CHUNK_ELEMENTS = 37
        for dim in (0, 1):
            ref, layer = _reference_and_sharded(11, 29, True, dim, torch.float32, seed=3)
            (o0, o1), (i0, i1) = layer._out_range, layer._in_range
            assert torch.equal(layer.weight, ref.weight[o0:o1, i0:i1])
            assert torch.equal(layer.bias, ref.bias if dim == 0 else ref.bias[o0:o1])
    finally:
        ts_init.CHUNK_ELEMENTS = saved
    ref, layer = _reference_and_sharded(300, 7001, True, 1, torch.float32, seed=5)
    (o0, o1), _ = layer._out_range, layer._in_range
    assert torch.equal(layer.weight, ref.weight[o0:o1])


def case_column_then_row_mlp_trains_like_unsharded():
    size = GROUP_SIZE()
    hidden = 6 * size + 1
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 4)).double()
    torch.manual_seed(0)
    model = nn.Sequential(ts.nn.ParallelLinear(10, hidden, dim=1), nn.ReLU(),
                          ts.nn.ParallelLinear(hidden, 4, dim=0)).double()
    with torch.no_grad():  # same starting point as the reference
        model[0].weight.copy_(shard_of(ref[0].weight, 0))
        model[0].bias.copy_(shard_of(ref[0].bias, 0))
        model[2].weight.copy_(shard_of(ref[2].weight, 1))
        model[2].bias.copy_(ref[2].bias)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    for step in range(5):
        x, y = torch.randn(8, 10, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
        for net, opt_ in ((ref, opt_ref), (model, opt)):
            opt_.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt_.step()
    assert_close(model[0].weight, shard_of(ref[0].weight, 0), torch.float64, "layer 0 weight")
    assert_close(model[0].bias, shard_of(ref[0].bias, 0), torch.float64, "layer 0 bias")
    assert_close(model[2].weight, shard_of(ref[2].weight, 1), torch.float64, "layer 2 weight")
    assert_close(model[2].bias, ref[2].bias, torch.float64, "layer 2 bias")


def case_convert_parallel_linear_nested():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(6, 9), nn.Tanh())
            self.head = nn.Linear(9, 5, bias=False)

        def forward(self, x):
            return self.head(self.inner(x))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(5, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    expected = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = ts.nn.ParallelLinear.convert_parallel_linear(model, dim=1)
    layers = [m for m in converted.modules() if isinstance(m, ts.nn.ParallelLinear)]
    assert len(layers) == 3 and not any(type(m) is nn.Linear for m in converted.modules())
    assert torch.equal(converted[0].inner[0].weight, shard_of(state["0.inner.0.weight"], 0))
    # Column-parallel layers in a chain need their outputs gathered: check each.
    h = ts.distributed.gather(converted[0].inner[0](x), -1, full_size=9)
    assert_close(h, model[0].inner[0].__class__  # noqa: E501 (reference from saved state)
                 and nn.functional.linear(x, state["0.inner.0.weight"], state["0.inner.0.bias"]),
                 torch.float64, "converted layer")
    single = ts.nn.ParallelLinear.convert_parallel_linear(nn.Linear(6, 4).double(), dim=0)
    assert isinstance(single, ts.nn.ParallelLinear) and single.dim == 0
    del expected


def case_mappings_forward_and_adjoint():
    size, rank = GROUP_SIZE(), ts.distributed.get_group_rank()
    torch.manual_seed(3)
    for total in (4 * size, 4 * size + 3):
        full = torch.randn(3, total, 2, dtype=torch.float64)
        mine = shard_of(full, 1).clone().requires_grad_()
        # gather_replicated: all-gather forward, keep the slice backward.
        g = ts.distributed.gather_replicated(mine, 1)
        assert torch.equal(g, full)
        (g * 2).sum().backward()
        assert torch.equal(mine.grad, torch.full_like(mine, 2.0))
        mine.grad = None
        # gather / all_gather: backward sums the group's gradients (reduce-scatter).
        for gather in (ts.distributed.gather, ts.distributed.all_gather):
            mine.grad = None
            g = gather(mine, 1, full_size=total)
            assert torch.equal(g, full)
            g.sum().backward()
            assert torch.equal(mine.grad, torch.full_like(mine, float(size)))
        # scatter: slice forward, all-gather backward.
        whole = full.clone().requires_grad_()
        s = ts.distributed.scatter(whole, 1)
        assert torch.equal(s, shard_of(full, 1))
        (s * (rank + 1)).sum().backward()
        weights = torch.cat([torch.full((3, hi - lo, 2), float(r + 1), dtype=torch.float64)
                             for r, (lo, hi) in enumerate(split_range(total, size, r) for r in range(size))], 1)
        assert torch.equal(whole.grad, weights)
        # reduce_scatter: sum then keep the slice; backward all-gathers.
        contrib = (full * (rank + 1)).requires_grad_()
        rs = ts.distributed.reduce_scatter(contrib, 1)
        factor = size * (size + 1) / 2
        torch.testing.assert_close(rs, shard_of(full, 1) * factor)
        rs.sum().backward()
        assert torch.equal(contrib.grad, torch.ones_like(full))
    # copy / reduce: identity <-> all-reduce.
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    c = ts.distributed.copy(x)
    assert torch.equal(c, x)
    c.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, float(size)))
    x.grad = None
    r = ts.distributed.reduce(x)
    assert torch.equal(r, torch.full_like(x, size * (size + 1) / 2))
    r.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def case_gather_without_full_size_checks_split_rule():
    size, rank = GROUP_SIZE(), ts.distributed.get_group_rank()
    if size < 2:
        return
    # Sizes that break the split rule (last rank larger) are refused on every rank.
    bad = torch.zeros(2, 1 + (1 if rank == size - 1 else 0))
    expect_error(lambda: ts.distributed.gather(bad, -1), "split rule", exception=RuntimeError)


def case_bad_input_errors():
    size = GROUP_SIZE()
    col = ts.nn.ParallelLinear(8, 4 * size, dim=1)
    row = ts.nn.ParallelLinear(8 * size, 4, dim=0)
    expect_error(lambda: col(torch.randn(2, 9)), "input.size(-1) must equal in_features = 8")
    expect_error(lambda: row(torch.randn(2, 8 * size + 5)), "dim=0", "input.size(-1)")
    expect_error(lambda: col(torch.randn(2, 8, dtype=torch.float64)), "same dtype")
    expect_error(lambda: col(torch.randn(2, 8, device="meta")), "same device")
    expect_error(lambda: ts.nn.ParallelLinear(4, 4, dim=2), "dim must be None, 0, 1 or -1")
    expect_error(lambda: torch.ops.shard.parallel_linear(torch.randn(2, 4), torch.randn(3, 4), None, 2, "tp"),
                 "dim must be None, 0, 1 or -1, got 2")
    expect_error(lambda: torch.ops.shard.parallel_linear(torch.randn(2, 4), torch.randn(3, 4), None, 1, "nope"),
                 "unknown group 'nope'", "'tp'")
    expect_error(lambda: torch.ops.shard.parallel_linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(2), 1, "tp"),
                 "bias must be 1-D of size weight.size(0) = 3")
    expect_error(lambda: torch.ops.shard.parallel_linear(torch.randint(0, 3, (2, 4)), torch.randn(3, 4), None, 1, "tp"),
                 "floating point")
    expect_error(lambda: ts.distributed.gather(torch.randn(2, 3), -1, full_size=5 * size + 100), "full_size")
    expect_error(lambda: ts.distributed.scatter(torch.randn(2, 3), 5), "dim must be in")
    marked = ts.utils.register_parallel_dim(torch.randn(2, 3), -1)
    if size > 1:
        expect_error(lambda: ts.nn.ParallelLinear(8 * size + 7, 2, dim=0)(marked), "marked as sharded")


def case_torchscript_module_and_function():
    size = GROUP_SIZE()
    torch.manual_seed(0)
    model = nn.Sequential(ts.nn.ParallelLinear(6, 4 * size + 1, dim=1), nn.ReLU(),
                          ts.nn.ParallelLinear(4 * size + 1, 3, dim=0)).double()
    scripted = torch.jit.script(model)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    eager, script = model(x), scripted(x2)
    assert torch.equal(eager, script)
    eager.sum().backward()
    script.sum().backward()
    assert torch.equal(x.grad, x2.grad)

    @torch.jit.script
    def column_then_gather(inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor, total: int) -> torch.Tensor:
        y = torch.ops.shard.parallel_linear(inp, w, b, 1, "tp")
        return torch.ops.shard.gather_replicated(y, -1, "tp", total)

    layer = model[0]
    y = column_then_gather(x2.detach(), layer.weight, layer.bias, 4 * size + 1)
    assert y.shape == (5, 4 * size + 1)


def case_torch_compile_fullgraph_matches_eager():
    size = GROUP_SIZE()
    torch.manual_seed(0)
    model = nn.Sequential(ts.nn.ParallelLinear(6, 4 * size + 1, dim=1), nn.ReLU(),
                          ts.nn.ParallelLinear(4 * size + 1, 3, dim=0)).double()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 6, dtype=torch.float64)
    eager = model(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(x)
    torch.testing.assert_close(out, eager)
    out.sum().backward()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
