"""A small model with every kind of state-dict entry, built sharded or plain
from the same seed: sharded embeddings (both dims), column- and row-parallel
linears with uneven splits (out_features 7 and 11), replicated parameters and
buffers (LayerNorm, BatchNorm), nested modules."""
import os

import torch
from torch import nn

import shardtorch as ts
from shardtorch.checkpoint import sharded_format

VOCAB, WIDTH, HIDDEN, OUT = 13, 6, 11, 7


class Block(nn.Module):
    def __init__(self, parallel: bool):
        super().__init__()
        linear = (lambda i, o, dim, **kw: ts.nn.ParallelLinear(i, o, dim=dim, **kw)) if parallel else \
            (lambda i, o, dim, **kw: nn.Linear(i, o, **kw))
        self.up = linear(WIDTH, HIDDEN, 1)
        self.down = linear(HIDDEN, OUT, 0)
        self.norm = nn.LayerNorm(OUT)


class Net(nn.Module):
    def __init__(self, parallel: bool):
        super().__init__()
        if parallel:
            self.tokens = ts.nn.ParallelEmbedding(VOCAB, WIDTH, padding_idx=1, dim=0)
            self.positions = ts.nn.ParallelEmbedding(5, WIDTH, dim=1)
        else:
            self.tokens = nn.Embedding(VOCAB, WIDTH, padding_idx=1)
            self.positions = nn.Embedding(5, WIDTH)
        self.block = Block(parallel)
        self.bn = nn.BatchNorm1d(OUT)
        self.head = ts.nn.ParallelLinear(OUT, OUT, bias=False, dim=1) if parallel else \
            nn.Linear(OUT, OUT, bias=False)

    def forward(self, tokens):
        h = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[-1]) % 5)
        h = self.block.up(h).relu()
        if isinstance(self.block.up, ts.nn.ParallelLinear):
            h = ts.distributed.gather(h, -1, full_size=HIDDEN)
        h = self.block.norm(self.block.down(h))
        out = self.head(self.bn(h.transpose(1, 2)).transpose(1, 2))
        if isinstance(self.head, ts.nn.ParallelLinear):
            out = ts.distributed.gather(out, -1, full_size=OUT)
        return out


def build(parallel: bool, seed: int, dtype=torch.float32) -> nn.Module:
    """The same weights sharded or not; buffers made distinctive per seed."""
    torch.manual_seed(seed)
    model = Net(parallel).to(dtype)
    with torch.no_grad():
        model.bn.running_mean.fill_(seed / 100)
        model.bn.num_batches_tracked.fill_(seed)
        model.block.norm.weight.fill_(1 + seed / 1000)
    return model


def assert_state_equal(actual: dict, expected: dict, what: str) -> None:
    assert list(actual) == list(expected), f"{what}: keys {list(actual)} != {list(expected)}"
    for key in expected:
        a, e = actual[key], expected[key]
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {key} {a.shape}/{a.dtype} != {e.shape}/{e.dtype}"
        assert torch.equal(a, e), f"{what}: {key} differs"


def die_after_writing_shard_file() -> None:
    """Makes this rank's next save_sharded end the process (no cleanup, no
    exception handling) right after it has written its shard file: a save
    killed midway."""
    writer = sharded_format.write_atomically

    def dies_after_shard_file(target, write):
        writer(target, write)
        if os.path.basename(target).startswith("rank-"):
            os._exit(17)

    sharded_format.write_atomically = dies_after_shard_file
