"""A small model trained with every optimizer whose state must follow the
shards, built sharded or plain from the same seed, and its unsharded float64
reference trajectory. Every rank computes the same loss on the same batch, so
the tensor-parallel gradients equal the unsharded ones (gather_replicated keeps
the local slice in backward) and data-parallel replicas stay identical."""
import torch
from torch import nn

import shardtorch as ts

VOCAB, WIDTH, HIDDEN, OUT, CLASSES, SEQ = 13, 6, 11, 7, 9, 5
SAVED_SEED, FRESH_SEED = 11, 22
K_STEPS, M_STEPS = 3, 2   # steps before the save, steps after the load


class Net(nn.Module):
    def __init__(self, parallel: bool):
        super().__init__()
        self.parallel = parallel
        if parallel:
            self.tokens = ts.nn.ParallelEmbedding(VOCAB, WIDTH, padding_idx=1, dim=0)
            self.positions = ts.nn.ParallelEmbedding(SEQ, WIDTH, dim=1)
            self.up = ts.nn.ParallelLinear(WIDTH, HIDDEN, dim=1)        # uneven: 11 over 2, 3, 4
            self.down = ts.nn.ParallelLinear(HIDDEN, OUT, dim=0)        # row-parallel, whole bias
            self.head = ts.nn.ParallelLinear(OUT, CLASSES, bias=False, dim=1)
        else:
            self.tokens = nn.Embedding(VOCAB, WIDTH, padding_idx=1)
            self.positions = nn.Embedding(SEQ, WIDTH)
            self.up = nn.Linear(WIDTH, HIDDEN)
            self.down = nn.Linear(HIDDEN, OUT)
            self.head = nn.Linear(OUT, CLASSES, bias=False)
        self.norm = nn.LayerNorm(OUT)                                   # replicated

    def forward(self, tokens):
        h = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[-1]))
        h = self.norm(self.down(self.up(h).relu()))
        out = self.head(h)
        if self.parallel:
            out = ts.distributed.gather_replicated(out, -1, full_size=CLASSES)
        return out


def build(parallel: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Net(parallel).to(torch.float64)


def param_groups(model):
    """Two groups (embeddings and head; the rest) to exercise param_groups."""
    named = list(model.named_parameters())
    first = [p for n, p in named if n.split(".")[-2] in ("tokens", "positions", "head")]
    rest = [p for n, p in named if n.split(".")[-2] not in ("tokens", "positions", "head")]
    return [{"params": first}, {"params": rest, "lr_scale": 1.0}]


OPTIMIZERS = {
    "sgd_nesterov": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_momentum": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, dampening=0.1),
    "adam": lambda g: torch.optim.Adam(g, lr=0.01, amsgrad=True),
    "adamw": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.1, lr_decay=0.01),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=0.01, momentum=0.5, centered=True),
}


def make_optimizer(kind: str, model):
    groups = param_groups(model)
    optimizer = OPTIMIZERS[kind](groups)
    optimizer.param_groups[0]["lr"] *= 0.5   # the groups differ in a hyperparameter
    return optimizer


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    target = torch.randn(4, SEQ, CLASSES, generator=g, dtype=torch.float64)
    return tokens, target


def train(model, optimizer, steps):
    for step in steps:
        tokens, target = batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = ((model(tokens) - target) ** 2).mean()
        loss.backward()
        optimizer.step()


def reference(kind: str, steps: int):
    """The unsharded float64 model and optimizer after ``steps`` steps."""
    model = build(False, SAVED_SEED)
    optimizer = make_optimizer(kind, model)
    train(model, optimizer, range(steps))
    return model, optimizer


def max_error(actual: dict, expected: dict, what: str) -> float:
    """Largest absolute difference between two state dicts (model or
    optimizer); keys, shapes and non-tensor values must match exactly."""
    if "state" in expected and "param_groups" in expected:
        assert len(actual["param_groups"]) == len(expected["param_groups"]), what
        for a, e in zip(actual["param_groups"], expected["param_groups"]):
            ea = {k: v for k, v in a.items() if k != "param_names"}
            ee = {k: v for k, v in e.items() if k != "param_names"}
            assert ea == ee, f"{what}: param_groups {ea} != {ee}"
        assert sorted(actual["state"]) == sorted(expected["state"]), \
            f"{what}: state for {sorted(actual['state'])} != {sorted(expected['state'])}"
        worst = 0.0
        for index in expected["state"]:
            worst = max(worst, max_error(actual["state"][index], expected["state"][index], f"{what} [{index}]"))
        return worst
    assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    worst = 0.0
    for key, e in expected.items():
        a = actual[key]
        if not torch.is_tensor(e):
            assert a == e, f"{what}: {key} {a!r} != {e!r}"
            continue
        assert torch.is_tensor(a) and a.shape == e.shape and a.dtype == e.dtype, \
            f"{what}: {key} {getattr(a, 'shape', a)}/{getattr(a, 'dtype', '')} != {e.shape}/{e.dtype}"
        if e.numel():
            worst = max(worst, (a.double() - e.double()).abs().max().item())
    return worst
