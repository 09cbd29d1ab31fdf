"""Row-sparse optimizer state (shardtorch.optim) in checkpoints, run inside
test_optimizer_state.py's launches (cases_optimizer_state.py imports them).

A backbone (nn.Linear, replicated) and a sampled ParallelMarginLoss head
(sample_rate 0.3, row-sparse weight gradients) train with RowSparseSGD (with
and without dampening: with it a per-row ``row_step``) and RowSparseAdam
(per-row ``row_step``). At the saving size the collected state equals the
same optimizer over the unsharded model trained on the float64 reference loss
restricted to the kept classes; loaded back (relocate, load_sharded, load_dcp)
at the same size, training continues bitwise as if it had never stopped. At
another size the loaded state is the saved one exactly and continues as the
unsharded reference from it. Rows never kept keep their initial value and a
zero state throughout."""
import copy
import os

import torch
import torch.distributed as dist
from torch import nn

import shardtorch as ts
from tests.distributed.optimizer_models import max_error
from tests.reference import expect_error, margin_cross_entropy_reference, shard_range, split_range

IN, FEATURES, CLASSES, BATCH = 5, 4, 23, 4
RATE, SCALE, MARGINS, SEED = 0.3, 16.0, (1.0, 0.3, 0.1), 31
SAVED_SEED, FRESH_SEED = 5, 6
K_STEPS, M_STEPS = 3, 3
TOLERANCE = 1e-12

ROW_SPARSE = {
    "row_sgd": lambda p: ts.optim.RowSparseSGD(p, lr=0.3, momentum=0.9, weight_decay=1e-2),
    "row_sgd_dampened": lambda p: ts.optim.RowSparseSGD(p, lr=0.3, momentum=0.9, dampening=0.1),
    "row_adam": lambda p: ts.optim.RowSparseAdam(p, lr=0.05, weight_decay=1e-2),
}


class SampledHeadNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(IN, FEATURES)
        self.head = ts.nn.ParallelMarginLoss(FEATURES, CLASSES, SCALE, MARGINS, sample_rate=RATE,
                                             dtype=torch.float64, chunk_size=3, seed=SEED)

    def forward(self, x, y):
        return self.head(self.backbone(x), y)


def _build(kind, seed):
    torch.manual_seed(seed)
    model = SampledHeadNet()
    model.backbone.double()
    return model, ROW_SPARSE[kind](model.parameters())


def _batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, IN, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _kept_global(model):
    lo, _ = shard_range(CLASSES)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (model.head.last_sampled_classes + lo).tolist())
    return torch.tensor(sorted({c for kept in everyone for c in kept}), dtype=torch.int64)


def _train(model, optimizer, steps):
    """Trains; returns each step's kept classes (global, sorted)."""
    kept = []
    for step in steps:
        x, y = _batch(step)
        optimizer.zero_grad(set_to_none=True)
        model(x, y).backward()
        optimizer.step()
        kept.append(_kept_global(model))
    return kept


class _Reference:
    """The unsharded float64 model (the full class matrix one parameter) and
    the same optimizer over it, trained on the reference loss over the kept
    classes, its weight gradient made row-sparse on the kept rows."""

    def __init__(self, kind, seed=SAVED_SEED):
        torch.manual_seed(seed)
        self.backbone = nn.Linear(IN, FEATURES).double()
        self.weight = nn.Parameter(torch.empty(CLASSES, FEATURES, dtype=torch.float64).normal_(0, 0.01))
        self.initial_weight = self.weight.detach().clone()
        # The order of the sharded model's parameters: backbone, then head.
        self.optimizer = ROW_SPARSE[kind]([self.backbone.weight, self.backbone.bias, self.weight])

    def train(self, steps, kept):
        for step, classes in zip(steps, kept):
            x, y = _batch(step)
            self.optimizer.zero_grad(set_to_none=True)
            margin_cross_entropy_reference(self.backbone(x), self.weight, y, SCALE, MARGINS,
                                           kept_classes=classes).backward()
            dense = self.weight.grad
            self.weight.grad = torch.sparse_coo_tensor(classes.unsqueeze(0), dense[classes], dense.shape)
            self.optimizer.step()

    def model_state(self):
        return {"backbone.weight": self.backbone.weight, "backbone.bias": self.backbone.bias,
                "head.weight": self.weight}


def _dir(*parts):
    return os.path.join(os.environ["SHARDTORCH_OPTIM_STATE_DIR"], *parts)


def _tag():
    world, size = dist.get_world_size(), ts.distributed.get_group_size()
    return str(size) if world == size else f"{world // size}x{size}"


def _check_collected(model, optimizer, reference, kept, what):
    """Collected model and state against the reference; rows never kept at
    their initial value with zero state."""
    full_model = ts.collect_state_dict(model, model.state_dict())
    full_state = ts.collect_optimizer_state_dict(model, optimizer)
    for key, expected in reference.model_state().items():
        error = (full_model[key] - expected.detach()).abs().max().item()
        assert error <= TOLERANCE, f"{what}: {key} differs from the reference by {error:.3g}"
    state_error = max_error(full_state, reference.optimizer.state_dict(), f"{what} optimizer")
    assert state_error <= TOLERANCE, f"{what}: optimizer state differs from the reference by {state_error:.3g}"
    head = full_state["state"][2]
    never = torch.ones(CLASSES, dtype=torch.bool)
    for classes in kept:
        never[classes] = False
    assert never.any(), f"{what}: every class was kept once; the test needs rows never kept"
    assert torch.equal(full_model["head.weight"][never], reference.initial_weight[never]), what
    for key, value in head.items():
        assert not value[never].any(), f"{what}: {key} of rows never kept is not zero"
    if "row_step" in head:
        times = torch.zeros(CLASSES, dtype=torch.int64)
        for classes in kept:
            times[classes] += 1
        assert head["row_step"].dtype == torch.int64, head["row_step"].dtype
        assert torch.equal(head["row_step"], times), f"{what}: row_step {head['row_step']} != times kept {times}"
    return full_model, full_state


def _local(model, optimizer):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()})


def _assert_bitwise(actual, expected, what):
    for a, e, part in ((actual[0], expected[0], "model"), (actual[1], expected[1], "optimizer")):
        assert a.keys() == e.keys(), f"{what} {part}: {sorted(a)} != {sorted(e)}"
        for key in e:
            for name, value in (e[key].items() if isinstance(e[key], dict) else [("", e[key])]):
                mine = a[key][name] if name else a[key]
                assert mine.dtype == value.dtype and torch.equal(mine, value), \
                    f"{what} {part} {key} {name}: not bitwise the uninterrupted run's"


def _loaders(tag):
    """(name, load(model, optimizer)) for each way back from the checkpoints saved at ``tag``."""
    def relocate(model, optimizer):
        full = torch.load(_dir(f"row-sparse-{tag}.pt"), weights_only=True) if dist.get_rank() == 0 else None
        model.load_state_dict(ts.relocate_state_dict(model, full and full["model"]))
        optimizer.load_state_dict(ts.relocate_optimizer_state_dict(model, optimizer, full and full["optimizer"]))

    return [("relocate", relocate),
            ("load_sharded", lambda m, o: ts.load_sharded(m, _dir(f"row-sparse-sharded-{tag}"), optimizer=o)),
            ("load_dcp", lambda m, o: ts.checkpoint.load_dcp(m, _dir(f"row-sparse-dcp-{tag}"), optimizer=o))]


def case_row_sparse_state_saves_and_resumes_bitwise():
    tag = _tag()
    for kind in ROW_SPARSE:
        model, optimizer = _build(kind, SAVED_SEED)
        _train(model, optimizer, range(K_STEPS + M_STEPS))
        uninterrupted = _local(model, optimizer)

        model, optimizer = _build(kind, SAVED_SEED)
        kept = _train(model, optimizer, range(K_STEPS))
        reference = _Reference(kind)
        reference.train(range(K_STEPS), kept)
        full_model, full_state = _check_collected(model, optimizer, reference, kept, f"{kind} at {tag}")
        if dist.get_rank() == 0:
            torch.save({"model": full_model, "optimizer": full_state, "kept": kept},
                       _dir(f"row-sparse-{kind}-{tag}.pt"))
        ts.save_sharded(model, _dir(f"row-sparse-sharded-{kind}-{tag}"), optimizer=optimizer)
        ts.checkpoint.save_dcp(model, _dir(f"row-sparse-dcp-{kind}-{tag}"), optimizer=optimizer)
        for name, load in _loaders(f"{kind}-{tag}"):
            model, optimizer = _build(kind, FRESH_SEED)
            load(model, optimizer)
            _train(model, optimizer, range(K_STEPS, K_STEPS + M_STEPS))
            _assert_bitwise(_local(model, optimizer), uninterrupted, f"{kind} {name} at {tag}")


def _load_at_another_size(saved_tag):
    tag = _tag()
    for kind in ROW_SPARSE:
        saved = torch.load(_dir(f"row-sparse-{kind}-{saved_tag}.pt"), weights_only=True)
        for name, load in _loaders(f"{kind}-{saved_tag}"):
            what = f"{kind} {name} from {saved_tag} at {tag}"
            model, optimizer = _build(kind, FRESH_SEED)
            load(model, optimizer)
            loaded = ts.collect_optimizer_state_dict(model, optimizer)
            error = max_error(loaded, saved["optimizer"], what)
            assert error == 0.0, f"{what}: the loaded state differs from the saved one by {error:.3g}"
            kept = _train(model, optimizer, range(K_STEPS, K_STEPS + M_STEPS))
            reference = _Reference(kind, FRESH_SEED)
            reference.backbone.load_state_dict({"weight": saved["model"]["backbone.weight"],
                                                "bias": saved["model"]["backbone.bias"]})
            with torch.no_grad():
                reference.weight.copy_(saved["model"]["head.weight"])
            reference.initial_weight = _Reference(kind).initial_weight
            # A copy: torch's load_state_dict keeps the given tensors, and steps them in place.
            reference.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
            reference.train(range(K_STEPS, K_STEPS + M_STEPS), kept)
            _check_collected(model, optimizer, reference, saved["kept"] + kept, what)


def case_row_sparse_load_2():
    _load_at_another_size("2")


def case_row_sparse_load_4():
    _load_at_another_size("4")


def case_row_sparse_misshapen_row_state_fails_on_every_rank():
    """A row_step that is not one value per row is named, on every rank."""
    model, optimizer = _build("row_adam", SAVED_SEED)
    _train(model, optimizer, range(1))
    full = ts.collect_optimizer_state_dict(model, optimizer)
    bad = copy.deepcopy(full)
    bad["state"][2]["row_step"] = bad["state"][2]["row_step"][:-1]
    expect_error(lambda: ts.relocate_optimizer_state_dict(model, optimizer, bad if dist.get_rank() == 0 else None),
                 "'head.weight' state 'row_step' has shape (22,)", "one value per row (23), nor a scalar")
    last = dist.get_world_size() - 1
    rows = split_range(CLASSES, dist.get_world_size(), last)
    rows = rows[1] - rows[0]
    if dist.get_rank() == last:
        optimizer.state[model.head.weight]["row_step"] = torch.zeros(rows + 1, dtype=torch.int64)
    expect_error(lambda: ts.collect_optimizer_state_dict(model, optimizer),
                 f"rank {last}: parameter 'head.weight'",
                 f"state 'row_step' of shape ({rows + 1},) is neither shaped like the shard, one value per "
                 f"row ({rows}), nor a scalar")
    # Still in step: the good state loads and collects back exactly.
    on_src = full if dist.get_rank() == 0 else None
    optimizer.load_state_dict(ts.relocate_optimizer_state_dict(model, optimizer, on_src))
    assert max_error(ts.collect_optimizer_state_dict(model, optimizer), full, "after errors") == 0.0
