"""TorchShard's usage patterns on real ranks, against unsharded torch in float64.

Each case is code written the way TorchShard's users write it (its README,
tests and projects), with our own models: its names, layers it marks its
way and checkpoints, convert + plain torch DDP in both layouts, plain DDP
without the helper, gather in both uses, init and slicing helpers.
Launched at world 2 (one group) and world 4 as 2 x 2 (see test_torchshard.py).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import shardtorch as ts
from tests.reference import expect_error, shard_of, split_range

# TorchShard 0.1.0's public names, module by module (from its documentation
# and package): every one must exist here.
TORCHSHARD_NAMES = {
    "": ["TORCH_VERSION", "set_attribute", "_PARALLEL_DIM", "_ORDER_ATTR", "nn", "distributed",
         "collect_state_dict", "relocate_state_dict", "register_ddp_parameters_to_ignore", "get_parallel_dim",
         "register_parallel_dim", "register_parallel_attribute", "slice"],
    "distributed": ["is_initialized", "init_process_group", "destroy_process_group", "get_group", "get_world_size",
                    "get_group_size", "get_rank", "copy", "scatter", "reduce", "gather"],
    "nn": ["ParallelLinear", "ParallelCrossEntropyLoss", "RegisterParallelDim", "ParallelEmbedding", "init",
           "functional", "modules"],
    "nn.modules": ["ParallelLinear", "ParallelCrossEntropyLoss", "RegisterParallelDim", "ParallelEmbedding"],
    "nn.functional": ["parallel_linear", "parallel_cross_entropy", "ParallelCrossEntropy", "parallel_embedding"],
    "nn.init": ["shard_init_helper_"],
}
DP_TOLERANCE = 1e-9


def _size():
    return ts.distributed.get_group_size()


def _rank():
    return ts.distributed.get_group_rank()


def case_every_torchshard_name_exists():
    missing = []
    for module, names in TORCHSHARD_NAMES.items():
        owner = ts
        for part in filter(None, module.split(".")):
            owner = getattr(owner, part)
        missing += [f"ts.{module + '.' if module else ''}{n}" for n in names if not hasattr(owner, n)]
    assert not missing, missing
    assert ts._PARALLEL_DIM == "parallel_dim" and ts._ORDER_ATTR == "order_type"
    assert ts.TORCH_VERSION == tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def case_own_layers_carry_torchshard_marks():
    for dim in (None, 0, 1, -1):
        layer = ts.nn.ParallelLinear(6, 5, dim=dim)
        assert ts.get_parallel_dim(layer.weight) == dim and ts.get_parallel_dim(layer.bias) == dim, dim
        assert getattr(layer.weight, ts._ORDER_ATTR) == 0
    for dim in (None, 0, 1, -1):
        table = ts.nn.ParallelEmbedding(7, 6, dim=dim)
        assert ts.get_parallel_dim(table.weight) == dim and getattr(table.weight, ts._ORDER_ATTR) == 1
    # What the marks mean, as tensor dims: checked against the shapes.
    col, row = ts.nn.ParallelLinear(6, 4 * _size() + 1, dim=1), ts.nn.ParallelLinear(4 * _size() + 1, 3, dim=0)
    assert ts.utils.parameter_split_dim(col.weight) == 0 and ts.utils.parameter_split_dim(col.bias) == 0
    assert ts.utils.parameter_split_dim(row.weight) == 1 and ts.utils.parameter_split_dim(row.bias) is None
    assert col.weight.shape[0] == row.weight.shape[1] == split_range(4 * _size() + 1, _size(), _rank())[1] - \
        split_range(4 * _size() + 1, _size(), _rank())[0]


class _ArcStyleHead(nn.Module):
    """A classifier written TorchShard's way (as its arcface project does):
    the [classes, features] weight cut along its classes, marked with the
    layer dim (1), order_type left at 0."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        full = torch.randn(classes, features, dtype=torch.float64)
        self.weight = nn.Parameter(ts.distributed.scatter(full, dim=0).clone())
        ts.register_parallel_dim(self.weight, 1)

    def forward(self, x):
        logits = F.linear(ts.distributed.copy(x), self.weight)
        ts.register_parallel_dim(logits, -1)
        return logits


class _RowStyleLayer(nn.Module):
    """A row-parallel layer written TorchShard's way (its template): the
    [out, in] weight cut along in_features, weight and whole bias marked 0."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(ts.distributed.scatter(torch.randn(out_features, in_features,
                                                                      dtype=torch.float64), dim=1).clone())
        self.bias = nn.Parameter(torch.randn(out_features, dtype=torch.float64))
        ts.register_parallel_attribute(self.weight, 0, order_type=0)
        ts.register_parallel_attribute(self.bias, 0, order_type=0)

    def forward(self, x):
        return ts.distributed.reduce(F.linear(ts.distributed.scatter(x, -1), self.weight)) + self.bias


class _TableStyle(nn.Module):
    """A table marked with order_type 1 (the layer's order), cut along its columns."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(ts.distributed.scatter(torch.randn(5, 4 * _size() + 1, dtype=torch.float64),
                                                         dim=1).clone())
        ts.set_attribute(self.table, 1, order_type=1)


def case_torchshard_style_layers_checkpoint_whole():
    torch.manual_seed(0)
    dist.broadcast(torch.zeros(1), 0)  # every rank draws the same numbers below
    model = nn.Sequential(_RowStyleLayer(4 * _size() + 1, 6), _ArcStyleHead(6, 2 * _size() + 1), _TableStyle())
    torch.manual_seed(0)
    full = {"0.weight": torch.randn(6, 4 * _size() + 1, dtype=torch.float64),
            "0.bias": torch.randn(6, dtype=torch.float64),
            "1.weight": torch.randn(2 * _size() + 1, 6, dtype=torch.float64),
            "2.table": torch.randn(5, 4 * _size() + 1, dtype=torch.float64)}
    collected = ts.collect_state_dict(model, model.state_dict())
    for key, expected in full.items():
        assert torch.equal(collected[key], expected), (key, tuple(collected[key].shape), tuple(expected.shape))
    fresh = nn.Sequential(_RowStyleLayer(4 * _size() + 1, 6), _ArcStyleHead(6, 2 * _size() + 1), _TableStyle())
    fresh.load_state_dict(ts.relocate_state_dict(fresh, full))
    for (key, mine), (_, theirs) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(mine, theirs), key
    # A mark that names no layer dimension of the tensor is refused, not guessed.
    odd = nn.Module()
    odd.kernel = nn.Parameter(torch.zeros(2, 2, 3))
    ts.register_parallel_dim(odd.kernel, 0)
    expect_error(lambda: ts.collect_state_dict(odd, odd.state_dict()), "3-D parameter", "register_shard",
                 exception=ValueError)


def case_loss_reads_marks_torchshard_way():
    torch.manual_seed(1)
    classes = 3 * _size() + 1
    logits = torch.randn(5, classes, dtype=torch.float64)
    target = torch.randint(0, classes, (5,))
    expected = F.cross_entropy(logits, target)
    criterion = ts.nn.ParallelCrossEntropyLoss()
    for mark in (1, -1):  # a column-parallel output: sharded on its last dim
        shard = ts.register_parallel_dim(shard_of(logits, -1).clone(), mark)
        torch.testing.assert_close(criterion(shard, target), expected, rtol=1e-12, atol=1e-12)
    # A row-parallel output (0) and an unmarked one are whole: plain cross-entropy.
    for whole in (ts.register_parallel_dim(logits.clone(), 0), logits.clone()):
        torch.testing.assert_close(criterion(whole, target), expected, rtol=1e-12, atol=1e-12)
    # TorchShard's legacy arguments and its autograd-function name.
    shard = ts.register_parallel_dim(shard_of(logits, -1).clone(), -1)
    summed = ts.nn.ParallelCrossEntropyLoss(size_average=False)(shard, target)
    torch.testing.assert_close(summed, F.cross_entropy(logits, target, reduction="sum"), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ts.nn.functional.ParallelCrossEntropy.apply(shard_of(logits, -1), target),
                               expected, rtol=1e-12, atol=1e-12)


def case_gather_of_sharded_output_then_loss_on_every_rank():
    torch.manual_seed(2)
    reference = nn.Linear(6, 4 * _size() + 1).double()
    layer = ts.nn.ParallelLinear.from_linear(reference, dim=1)
    x = torch.randn(3, 6, dtype=torch.float64)
    target = torch.randint(0, reference.out_features, (3,))
    F.cross_entropy(reference(x), target).backward()
    # TorchShard's test_naive_col_parallel_linear: gather, then the loss on every rank.
    for output in (layer(x), torch.tanh(layer(x)) * 0 + layer(x)):  # marked, then unmarked (2-D, last dim)
        layer.zero_grad()
        F.cross_entropy(ts.distributed.gather(output, dim=-1), target).backward()
        torch.testing.assert_close(layer.weight.grad, shard_of(reference.weight.grad, 0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.bias.grad, shard_of(reference.bias.grad, 0), rtol=1e-12, atol=1e-12)
    # The batch dimension sums (the adjoint), explicitly chosen names too.
    mine = torch.full((2, 3), float(_rank() + 1), dtype=torch.float64, requires_grad=True)
    ts.distributed.gather(mine, dim=0).sum().backward()
    assert torch.equal(mine.grad, torch.full_like(mine, float(_size())))
    mine.grad = None
    ts.distributed.gather_replicated(mine, dim=0).sum().backward()
    assert torch.equal(mine.grad, torch.ones_like(mine))


def case_shard_init_helper_draws_the_whole_tensor():
    layer = ts.nn.ParallelLinear(5, 4 * _size() + 1, dim=1).double()
    rowl = ts.nn.ParallelLinear(4 * _size() + 1, 3, dim=0).double()
    torch.manual_seed(3)
    full_w = torch.empty(4 * _size() + 1, 5, dtype=torch.float64).normal_(0, 0.5)
    full_b = torch.empty(4 * _size() + 1, dtype=torch.float64).uniform_(-1, 1)
    full_r = torch.empty(3, 4 * _size() + 1, dtype=torch.float64).normal_(0, 0.5)
    full_rb = torch.empty(3, dtype=torch.float64).uniform_(-1, 1)
    torch.manual_seed(3 + dist.get_rank())  # rank 0's numbers must win, whatever the others draw
    ts.nn.init.shard_init_helper_(nn.init.normal_, layer.weight, mean=0.0, std=0.5)
    ts.nn.init.shard_init_helper_(nn.init.uniform_, layer.bias, a=-1.0, b=1.0)
    ts.nn.init.shard_init_helper_(nn.init.normal_, rowl.weight, mean=0.0, std=0.5)
    ts.nn.init.shard_init_helper_(nn.init.uniform_, rowl.bias, a=-1.0, b=1.0)
    for t in (full_w, full_b, full_r, full_rb):  # rank 0's draw is the truth
        dist.broadcast(t, 0)
    assert torch.equal(layer.weight, shard_of(full_w, 0)) and torch.equal(layer.bias, shard_of(full_b, 0))
    assert torch.equal(rowl.weight, shard_of(full_r, 1)) and torch.equal(rowl.bias, full_rb)


def case_slice_register_module_and_functional_embedding():
    x = torch.arange(2 * (3 * _size() + 1), dtype=torch.float64).reshape(2, -1)
    pieces = ts.slice(x, _size())
    assert torch.equal(torch.cat(pieces, -1), x) and torch.equal(pieces[_rank()], ts.distributed.scatter(x, -1))
    assert all(p.is_contiguous() for p in ts.slice(x, _size(), dim=-1, contiguous=True))
    marker = ts.nn.RegisterParallelDim(dim=-1)
    a, b = marker([torch.zeros(2), torch.ones(2)])
    assert ts.get_parallel_dim(a) == ts.get_parallel_dim(b) == -1
    expect_error(lambda: ts.nn.RegisterParallelDim(dim=2), "value must be None, 0, 1 or -1", exception=ValueError)
    torch.manual_seed(4)
    table = torch.randn(4 * _size() + 1, 3 * _size() + 2, dtype=torch.float64)
    tokens = torch.randint(0, table.shape[0], (2, 5))
    expected = F.embedding(tokens, table)
    for dim, split in ((0, 0), (1, 1), (-1, 1)):
        got = ts.nn.functional.parallel_embedding(tokens, shard_of(table, split), num_embeddings=table.shape[0],
                                                  dim=dim)
        assert torch.equal(got, expected), dim
        layer = ts.nn.ParallelEmbedding(*table.shape, dim=dim, dtype=torch.float64)
        with torch.no_grad():
            layer.weight.copy_(shard_of(table, split))
        assert torch.equal(layer(tokens), expected), dim
    plain = ts.nn.ParallelEmbedding(*table.shape, dtype=torch.float64)  # dim=None, TorchShard's default
    assert plain.weight.shape == table.shape and not ts.utils.registered_shards(plain)


# ---- convert + plain torch DDP against unsharded training (world 4: 2 x 2, and one group of 2)

IN, WIDTH, CLASSES, PER_RANK, STEPS = 5, 8, 2 * 4 + 3, 3, 3


class _Net(nn.Module):
    def __init__(self, gather_batch: bool, classes: int = CLASSES):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, WIDTH), nn.Tanh())
        self.fc = nn.Linear(WIDTH, classes)
        self.gather_batch = gather_batch

    def forward(self, x):
        h = self.body(x)
        if self.gather_batch:  # TorchShard's recipe: the group's batch before the sharded head
            h = ts.distributed.gather(h, dim=0)
        return self.fc(h)


def _reference_and_batches():
    torch.manual_seed(5)
    reference = _Net(False).double()
    world = dist.get_world_size()
    batches = [(torch.randn(PER_RANK * world, IN, dtype=torch.float64),
                torch.randint(0, CLASSES, (PER_RANK * world,))) for _ in range(STEPS)]
    return reference, batches


def _train_reference(reference, batches):
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()


def _rows(layout: str, total: int):
    """This rank's rows of the global batch: its own (hybrid, DDP over the
    world) or its tensor-parallel group's (2d, DDP over the data-parallel group)."""
    if layout == "hybrid":
        lo, hi = split_range(total, dist.get_world_size(), dist.get_rank())
    else:
        dp = ts.distributed.get_data_parallel_group()
        lo, hi = split_range(total, dist.get_world_size(dp), dist.get_rank(dp))
    return slice(lo, hi)


def _check_trains_like_reference(model, ddp, reference, batches, layout: str, head_dim: int):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    criterion = ts.nn.ParallelCrossEntropyLoss()
    for x, y in batches:
        rows = _rows(layout, x.shape[0])
        x, y = x[rows], y[rows]
        opt.zero_grad()
        logits = ddp(x)
        if layout == "hybrid":
            y = ts.distributed.gather(y, dim=0)
        criterion(logits, y).backward()
        opt.step()
    _train_reference(reference, batches)
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        split = ts.utils.parameter_split_dim(p)
        want = expected[name] if split is None else shard_of(expected[name], split)
        err = (p.detach() - want.detach()).abs().max().item()
        assert err <= DP_TOLERANCE, (layout, head_dim, name, err)


def _converted(layout: str, head_dim: int) -> nn.Module:
    """TorchShard's imagenet recipe: build, convert_parallel_linear the whole
    model (every nn.Linear), so the root's ignore list covers the shards."""
    torch.manual_seed(5)
    model = _Net(layout == "hybrid").double()
    body = model.body
    model.body = nn.Identity()  # only the head is converted, as imagenet converts its fc
    model = ts.nn.ParallelLinear.convert_parallel_linear(model, dim=head_dim)
    model.body = body
    return model


def _plain_ddp(model, layout: str):
    if layout == "hybrid":
        return TorchDDP(model)
    return TorchDDP(model, process_group=ts.distributed.get_data_parallel_group())


def case_convert_then_plain_ddp_trains_like_unsharded():
    for layout in ("hybrid", "2d"):
        for head_dim in (1, 0):
            reference, batches = _reference_and_batches()
            model = _converted(layout, head_dim)
            assert sorted(model._ddp_params_and_buffers_to_ignore) == \
                (["fc.bias", "fc.weight"] if head_dim == 1 else ["fc.weight"])
            _check_trains_like_reference(model, _plain_ddp(model, layout), reference, batches, layout, head_dim)


def case_register_ddp_parameters_to_ignore_on_torchshard_style_layer():
    # A hand-written column-parallel head, marked only on the tensor.
    for layout in ("hybrid", "2d"):
        reference, batches = _reference_and_batches()
        torch.manual_seed(5)
        model = _Net(layout == "hybrid").double()
        full = model.fc
        model.fc = _MarkedHead(full)
        ignored = ts.register_ddp_parameters_to_ignore(model)
        assert ignored == ["fc.bias", "fc.weight"], ignored
        _check_trains_like_reference(model, _plain_ddp(model, layout), reference, batches, layout, 1)


class _MarkedHead(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(ts.distributed.scatter(full.weight.detach(), dim=0).clone())
        self.bias = nn.Parameter(ts.distributed.scatter(full.bias.detach(), dim=0).clone())
        ts.register_parallel_dim(self.weight, 1)
        ts.register_parallel_dim(self.bias, 1)

    def forward(self, x):
        out = F.linear(ts.distributed.copy(x), self.weight, self.bias)
        ts.register_parallel_dim(out, -1)
        return out


def case_plain_ddp_without_the_helper_works_or_raises():
    # 2-D: DDP over the data-parallel group holds one copy of each shard: exact.
    reference, batches = _reference_and_batches()
    torch.manual_seed(5)
    model = _Net(False).double()
    model.fc = ts.nn.ParallelLinear.from_linear(model.fc, dim=1)
    _check_trains_like_reference(model, _plain_ddp(model, "2d"), reference, batches, "2d", 1)
    # Hybrid: DDP over the world would mix different shards: the first step
    # raises, on every rank. (Uneven shards do not get that far: torch's DDP
    # refuses parameters of different shapes at construction.)
    even = 4 * _size()
    torch.manual_seed(5)
    model = _Net(True, even).double()
    model.fc = ts.nn.ParallelLinear.from_linear(model.fc, dim=1)
    ddp = TorchDDP(model)
    expect_error(lambda: ddp(torch.randn(2, IN, dtype=torch.float64)), "'fc.weight' is a shard",
                 "register_ddp_parameters_to_ignore", exception=RuntimeError)
    # The same for a layer marked only on its tensors.
    torch.manual_seed(5)
    model = _Net(True, even).double()
    model.fc = _MarkedHead(model.fc)
    ddp = TorchDDP(model)
    expect_error(lambda: ddp(torch.randn(2, IN, dtype=torch.float64)), "'fc.weight' is a shard",
                 exception=RuntimeError)


def case_register_after_wrapping_is_refused():
    model = _Net(True, 4 * _size()).double()
    model.fc = ts.nn.ParallelLinear.from_linear(model.fc, dim=1)
    ddp = TorchDDP(model)
    expect_error(lambda: ts.register_ddp_parameters_to_ignore(ddp), "already built", "before wrapping",
                 exception=ValueError)
