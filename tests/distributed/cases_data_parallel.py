"""Data x tensor parallel training on real ranks, against single-process
unsharded training on the concatenated global batch.

Every rank builds the unsharded reference itself (same seeds), trains it on
the whole global batch, and compares each of its parameters (the reference
sliced for shards) after training. Layouts (see ts.nn.parallel):
- "hybrid": DDP over the world, each rank its own slice of the batch, the
  features and targets gathered over the tensor-parallel group before the head;
- "2d": every rank of a tensor-parallel group sees its group's slice; DDP over
  the data-parallel group.
The launches run world 4 with group_size 2 (M = 2 data-parallel replicas) and
group_size 4 (M = 1).
"""
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DistributedSampler

import shardtorch as ts
from tests.reference import shard_of

NUM_CLASSES = 37  # uneven over 2 and 4 ranks
IN_FEATURES, WIDTH, HIDDEN = 6, 12, 9
SAMPLES_PER_RANK = 4
STEPS = 4
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}
# test_data_parallel.py reads the report from the session's scratch folder (harness.scratch_dir).
REPORT_FILE = "data-parallel.jsonl"


def sharded_head_loss(logits: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mean cross-entropy of column-parallel logits (sharded on the last dim)
    against global class indices, the same on every rank of the group."""
    if hasattr(ts.nn, "ParallelCrossEntropyLoss"):
        return ts.nn.ParallelCrossEntropyLoss(parallel=True)(logits, target)
    # Stand-in until the parallel loss (another branch) is merged: exact,
    # because everything after gather_replicated is computed identically on
    # every rank of the group, so its keep-the-slice backward is the adjoint.
    whole = ts.distributed.gather_replicated(logits, -1, full_size=num_classes)
    return F.cross_entropy(whole, target)


def _linear(parallel: bool, in_features: int, out_features: int, dim: int) -> nn.Module:
    if parallel:
        return ts.nn.ParallelLinear(in_features, out_features, dim=dim)
    return nn.Linear(in_features, out_features)


class Backbone(nn.Module):
    """Replicated layers (a residual block), under DDP on every rank."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(IN_FEATURES, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        return h + torch.tanh(self.block(h))


class Head(nn.Module):
    """Column -> row parallel block (its row bias whole) and a column-parallel
    classifier over NUM_CLASSES; unsharded nn.Linear for the reference."""

    def __init__(self, parallel: bool, dropout: float = 0.0):
        super().__init__()
        self.up = _linear(parallel, WIDTH, HIDDEN, 1)
        self.down = _linear(parallel, HIDDEN, WIDTH, 0)
        self.classifier = _linear(parallel, WIDTH, NUM_CLASSES, 1)
        self.dropout = dropout

    def forward(self, h):
        inner = torch.relu(self.up(h))
        if self.dropout:
            with ts.random.fork():  # sharded activation: a different mask per shard
                inner = F.dropout(inner, self.dropout)
        h = h + self.down(inner)
        if self.dropout:  # replicated activation: the same mask on every rank of the group
            h = F.dropout(h, self.dropout)
        return self.classifier(h)


class Net(nn.Module):
    def __init__(self, parallel: bool, gather_batch: bool = False, checkpoint_head: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.backbone = Backbone()
        self.head = Head(parallel, dropout)  # nested: head.classifier.weight etc.
        self.gather_batch, self.checkpoint_head = gather_batch, checkpoint_head

    def forward(self, x):
        h = self.backbone(x)
        if self.gather_batch:  # hybrid layout: the group's batch, adjoint gather
            h = ts.distributed.gather(h, dim=0)
        if self.checkpoint_head:
            return ts.random.checkpoint(self.head, h)
        return self.head(h)


def _build(parallel: bool, dtype, seed: int = 1234, **kwargs) -> Net:
    torch.manual_seed(seed)  # ParallelLinear draws nn.Linear's numbers and slices them
    return Net(parallel, **kwargs).to(dtype)


def _global_batch(step: int, dtype):
    generator = torch.Generator().manual_seed(100 + step)
    batch = SAMPLES_PER_RANK * dist.get_world_size()
    x = torch.randn(batch, IN_FEATURES, generator=generator, dtype=torch.float64).to(dtype)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    return x, y


def _local_batch(layout: str, x, y, step: int = 0):
    """The rows this rank reads, as its sampler picks them: its own (torch's
    DistributedSampler over the world, hybrid) or its group's
    (DistributedGroupSampler, 2d). The losses are means, so the order in which
    the rows are gathered does not matter."""
    rows = range(x.shape[0])
    if layout == "hybrid":
        sampler = DistributedSampler(rows, shuffle=True, seed=11)
    else:
        sampler = ts.utils.data.DistributedGroupSampler(rows, shuffle=True, seed=11)
    sampler.set_epoch(step)
    mine = torch.tensor(list(sampler))
    return x[mine], y[mine]


def _make_optimizer(name: str, parameters, zero_group=None):
    cls, kwargs = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                   "adam": (torch.optim.Adam, {"lr": 0.01})}[name]
    if zero_group is not None:
        return ZeroRedundancyOptimizer(parameters, optimizer_class=cls, process_group=zero_group, **kwargs)
    return cls(parameters, **kwargs)


def _sharded_loss(ddp, layout: str, x, y):
    logits = ddp(x)
    if layout == "hybrid":  # the targets of the gathered batch
        y = ts.distributed.gather(y, dim=0)
    return sharded_head_loss(logits, y, NUM_CLASSES)


def _relative_error(model: nn.Module, reference: nn.Module, initial=None) -> float:
    """Largest over parameters of max|p - p_ref| / max|p_ref| (shards against
    the reference's slice); with ``initial`` (a copy of the starting
    parameters) compares the updates p - p0 instead."""
    worst = 0.0
    expected_by_name = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        expected = expected_by_name[name].detach()
        dim = ts.utils.parameter_split_dim(p)
        if dim is not None:
            expected = shard_of(expected, dim)
        actual = p.detach()
        if initial is not None:
            actual, expected = actual - initial[0][name], expected - initial[1][name]
        scale = expected.double().abs().max().clamp_min(1e-30)
        worst = max(worst, ((actual.double() - expected.double()).abs().max() / scale).item())
    return worst


def _report(**fields) -> None:
    scratch = os.environ.get("SHARDTORCH_TEST_SCRATCH")
    if scratch and dist.get_rank() == 0:
        fields.update(world=dist.get_world_size(), group_size=ts.distributed.get_group_size())
        with open(os.path.join(scratch, REPORT_FILE), "a") as f:
            f.write(json.dumps(fields) + "\n")


def _train_and_compare(layout: str, optimizer: str, dtype=torch.float64, steps: int = STEPS,
                       accumulate: int = 1, zero: bool = False, checkpoint_head: bool = False,
                       autocast_dtype=None, tolerance=None, what: str = ""):
    reference = _build(False, dtype)
    model = _build(True, dtype, gather_batch=(layout == "hybrid"), checkpoint_head=checkpoint_head)
    ddp = ts.nn.parallel.DistributedDataParallel(model, layout=layout)
    zero_group = ts.distributed.get_data_parallel_group() if zero else None
    opt_ref = _make_optimizer(optimizer, reference.parameters())
    opt = _make_optimizer(optimizer, ddp.parameters(), zero_group)
    initial = ({n: p.detach().clone() for n, p in model.named_parameters()},
               {n: (shard_of(p, ts.utils.parameter_split_dim(q)) if ts.utils.parameter_split_dim(q) is not None else p)
                .detach().clone() for (n, p), q in zip(reference.named_parameters(), model.parameters())})
    autocast = (lambda: torch.autocast("cpu", dtype=autocast_dtype)) if autocast_dtype else None
    for step in range(steps):
        x, y = _global_batch(step, dtype)
        opt_ref.zero_grad()
        if autocast:
            with autocast():
                loss_ref = F.cross_entropy(reference(x), y)
        else:
            loss_ref = F.cross_entropy(reference(x), y)
        loss_ref.backward()
        opt_ref.step()

        opt.zero_grad()
        x_local, y_local = _local_batch(layout, x, y, step)
        micro_x, micro_y = x_local.chunk(accumulate), y_local.chunk(accumulate)
        for i, (xm, ym) in enumerate(zip(micro_x, micro_y)):
            last = i == accumulate - 1
            context = torch.autocast("cpu", dtype=autocast_dtype) if autocast else _null()
            sync = _null() if last else ddp.no_sync()
            with sync:
                with context:
                    loss = _sharded_loss(ddp, layout, xm, ym) / accumulate
                loss.backward()
        opt.step()
    error = _relative_error(model, reference, initial if autocast else None)
    limit = tolerance or TOLERANCE[dtype]
    _report(layout=layout, optimizer=optimizer, dtype=str(dtype), accumulate=accumulate, zero=zero,
            checkpoint=checkpoint_head, autocast=str(autocast_dtype), what=what, max_relative_error=error)
    assert error <= limit, (f"{layout} {optimizer} {dtype} accumulate={accumulate} zero={zero} "
                            f"autocast={autocast_dtype} {what}: largest relative parameter error "
                            f"{error:.3g} > {limit:.3g}")
    return error


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------ exactness per layout
def case_hybrid_sgd_float64():
    _train_and_compare("hybrid", "sgd")


def case_hybrid_adam_float64():
    _train_and_compare("hybrid", "adam")


def case_2d_sgd_float64():
    _train_and_compare("2d", "sgd")


def case_2d_adam_float64():
    _train_and_compare("2d", "adam")


def case_hybrid_adam_float32():
    _train_and_compare("hybrid", "adam", torch.float32)


def case_2d_sgd_float32():
    _train_and_compare("2d", "sgd", torch.float32)


# ------------------------------------------------------------ accumulation, ZeRO, checkpoint
def case_gradient_accumulation_with_no_sync():
    for layout in ("hybrid", "2d"):
        _train_and_compare(layout, "sgd", accumulate=2, what="no_sync")


def case_hybrid_no_sync_keeps_sharded_gradients_local():
    # Under no_sync the shards' gradients stay local (data-parallel peers saw
    # different samples, so they differ); the next synchronising backward
    # averages the accumulated sum, after which peers agree.
    if ts.distributed.get_data_parallel_size() == 1:
        return
    model = _build(True, torch.float64, gather_batch=True)
    ddp = ts.nn.parallel.DistributedDataParallel(model, layout="hybrid")
    x, y = _local_batch("hybrid", *_global_batch(0, torch.float64))

    def peers_agree():
        grad = model.head.classifier.weight.grad[:NUM_CLASSES // 4].contiguous()
        everyone = _gather_world(grad)
        peers = ts.distributed.get_group_ranks(ts.distributed.DATA_PARALLEL)
        return all(torch.equal(everyone[peers[0]], everyone[p]) for p in peers)

    with ddp.no_sync():
        _sharded_loss(ddp, "hybrid", x, y).backward()
    assert not peers_agree(), "sharded gradients were averaged inside no_sync"
    loss = _sharded_loss(ddp, "hybrid", x, y)
    with torch.no_grad():  # an evaluation forward in between must not cancel the sync, as in DDP
        ddp(x)
    loss.backward()
    assert peers_agree(), "sharded gradients not averaged after no_sync"


def case_zero_over_data_parallel_group():
    # 2-D: ZeRO over the data-parallel group shards every parameter's state.
    # Hybrid: also over the data-parallel group (over the world it would
    # broadcast one rank's update of a shard to ranks holding other shards).
    for layout in ("2d", "hybrid"):
        _train_and_compare(layout, "adam", zero=True, what="ZeroRedundancyOptimizer")


def case_checkpointed_head_trains_like_reference():
    for layout in ("hybrid", "2d"):
        _train_and_compare(layout, "sgd", steps=2, checkpoint_head=True, what="checkpointed head")


def case_checkpoint_recompute_is_identical_with_dropout():
    torch.manual_seed(0)
    x = torch.randn(5, WIDTH, dtype=torch.float64)

    def grads(checkpoint_context):
        head = _build(True, torch.float64).head
        head.dropout = 0.3
        ts.random.model_parallel_seed(42)
        inp = x.clone().requires_grad_()
        out = checkpoint_context(head, inp) if checkpoint_context else head(inp)
        out.sum().backward()
        return [out.detach()] + [inp.grad] + [p.grad for p in head.parameters()]

    plain = grads(None)
    replayed = grads(ts.random.checkpoint)
    for a, b in zip(plain, replayed):
        assert torch.equal(a, b), "checkpoint recompute with ts.random streams changed results"
    # Without replaying the tracked stream, the recompute draws new sharded masks.
    unreplayed = grads(lambda f, a: torch.utils.checkpoint.checkpoint(f, a, use_reentrant=False))
    assert torch.equal(plain[0], unreplayed[0])
    assert not all(torch.equal(a, b) for a, b in zip(plain[1:], unreplayed[1:])), \
        "expected different gradients when the model-parallel stream is not replayed"


# ------------------------------------------------------------ AMP
def case_autocast_bfloat16():
    for layout in ("hybrid", "2d"):
        _train_and_compare(layout, "sgd", torch.float32, steps=3, autocast_dtype=torch.bfloat16,
                           tolerance=5e-2, what="autocast bfloat16 (updates compared)")


def case_autocast_float16_with_sharded_grad_scaler():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    for layout in ("hybrid", "2d"):
        model = _build(True, torch.float32, gather_batch=(layout == "hybrid"))
        ddp = ts.nn.parallel.DistributedDataParallel(model, layout=layout)
        opt = _make_optimizer("sgd", ddp.parameters())
        # found_inf must agree on every rank (shards differ), hence the world group.
        scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 10, process_group=dist.group.WORLD)
        for step in range(2):
            x, y = _local_batch(layout, *_global_batch(step, torch.float32))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _sharded_loss(ddp, layout, x, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            assert torch.isfinite(loss), loss
        # An overflow in one rank's shard only: every rank skips the step.
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _sharded_loss(ddp, layout, *_local_batch(layout, *_global_batch(9, torch.float32)))
        scaler.scale(loss).backward()
        if dist.get_rank() == 1:
            model.head.classifier.weight.grad[0, 0] = float("inf")
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() < scale, "scale not reduced after an overflow on rank 1"
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p.detach(), b), "a rank stepped although rank 1 overflowed"


# ------------------------------------------------------------ shards under DDP
def case_nested_head_keeps_distinct_shards_under_ddp():
    reference = _build(False, torch.float64)
    for layout in ("hybrid", "2d"):
        model = _build(True, torch.float64, gather_batch=(layout == "hybrid"))
        ts.nn.parallel.DistributedDataParallel(model, layout=layout)
        names = ts.nn.parallel.sharded_parameter_names(model)
        assert names == ["head.up.weight", "head.up.bias", "head.down.weight",
                         "head.classifier.weight", "head.classifier.bias"], names
        for name in names:  # still this rank's slice after DDP's constructor broadcast
            p = dict(model.named_parameters())[name]
            expected = shard_of(dict(reference.named_parameters())[name], ts.utils.parameter_split_dim(p))
            assert torch.equal(p.detach(), expected), f"{layout}: {name} lost its shard"
        # Ranks of one tensor-parallel group hold different shards of the classifier.
        first_rows = torch.zeros(dist.get_world_size(), WIDTH, dtype=torch.float64)
        first_rows[dist.get_rank()] = model.head.classifier.weight.detach()[0]
        dist.all_reduce(first_rows)
        peers = ts.distributed.get_group_ranks()
        for a in peers:
            for b in peers:
                if a != b:
                    assert not torch.equal(first_rows[a], first_rows[b]), (layout, a, b)


def case_hybrid_keeps_sharded_parameters_out_of_world_ddp():
    model = _build(True, torch.float64, gather_batch=True)
    ddp = ts.nn.parallel.DistributedDataParallel(model, layout="hybrid")
    ignored = set(ddp.parameters_to_ignore)
    assert ignored == set(ts.nn.parallel.sharded_parameter_names(model)), ignored
    assert "head.down.bias" not in ignored  # whole row-parallel bias: the world DDP averages it
    averager = ddp.sharded_gradient_averager
    if ts.distributed.get_data_parallel_size() == 1:
        assert averager is None
    else:
        assert len(averager.parameters) == 5


def case_layout_errors():
    model = _build(True, torch.float64)
    for call, fragment in ((lambda: ts.nn.parallel.DistributedDataParallel(model, layout="3d"),
                            "layout must be one of ('hybrid', '2d'), got '3d'"),
                           (lambda: ts.nn.parallel.DistributedDataParallel(
                               model, layout="2d", process_group=dist.group.WORLD), "process_group")):
        try:
            call()
        except ValueError as e:
            assert fragment in str(e), str(e)
        else:
            raise AssertionError(f"no error mentioning {fragment!r}")


# ------------------------------------------------------------ random streams
def _gather_world(t: torch.Tensor):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def case_dropout_masks_per_stream():
    tp_rank = [r % ts.distributed.get_group_size() for r in range(dist.get_world_size())]
    group_of = [r // ts.distributed.get_group_size() for r in range(dist.get_world_size())]

    def draw():
        ts.random.model_parallel_seed(2024)
        with ts.random.fork():
            sharded = F.dropout(torch.ones(6, 8), 0.5)
        replicated = F.dropout(torch.ones(6, 8), 0.5)
        return sharded, replicated

    sharded, replicated = draw()
    masks_sharded, masks_replicated = _gather_world(sharded), _gather_world(replicated)
    for a in range(dist.get_world_size()):
        for b in range(dist.get_world_size()):
            same = torch.equal(masks_sharded[a], masks_sharded[b])
            if tp_rank[a] == tp_rank[b]:
                assert same, f"ranks {a} and {b} hold the same shard but drew different masks"
            elif group_of[a] == group_of[b]:
                assert not same, f"shards {tp_rank[a]} and {tp_rank[b]} of one group drew one mask"
            if group_of[a] == group_of[b]:
                assert torch.equal(masks_replicated[a], masks_replicated[b]), \
                    f"replicated masks differ between ranks {a} and {b} of one group"
    again = draw()
    assert torch.equal(again[0], sharded) and torch.equal(again[1], replicated), "not reproducible"
    # fork() leaves the default stream where it was.
    ts.random.model_parallel_seed(7)
    expected = torch.rand(4)
    ts.random.model_parallel_seed(7)
    with ts.random.fork():
        torch.rand(100)
    assert torch.equal(torch.rand(4), expected), "fork() advanced the default stream"
    # Two forks continue the tracked stream instead of repeating it.
    ts.random.model_parallel_seed(7)
    with ts.random.fork():
        first = torch.rand(4)
    with ts.random.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second)


# ------------------------------------------------------------ the group sampler on real ranks
def case_group_sampler_on_ranks():
    dataset = list(range(23))
    sampler = ts.utils.data.DistributedGroupSampler(dataset, shuffle=True, seed=3)
    sampler.set_epoch(1)
    mine = torch.full((len(dataset),), -1, dtype=torch.int64)
    indices = list(sampler)
    mine[:len(indices)] = torch.tensor(indices)
    everyone = _gather_world(mine)
    size = ts.distributed.get_group_size()
    for r in range(dist.get_world_size()):
        assert torch.equal(everyone[r], everyone[r - r % size]), f"rank {r} differs from its group"
    firsts = [set(everyone[g * size].tolist()) - {-1} for g in range(dist.get_world_size() // size)]
    assert set().union(*firsts) == set(dataset)
