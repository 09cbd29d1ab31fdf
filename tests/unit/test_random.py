"""ts.random without processes: seeding, fork, checkpoint replay."""
import pytest
import torch
import torch.nn.functional as F

import shardtorch as ts


def test_seed_derivation_and_reproducibility():
    assert ts.random.model_parallel_seed(10) == (10, 10 + 2718)  # rank 0 of a group of one
    with ts.random.fork():
        first = torch.rand(5)
    ts.random.model_parallel_seed(10)
    with ts.random.fork():
        assert torch.equal(torch.rand(5), first)
    assert torch.equal(first, torch.rand(5, generator=torch.Generator().manual_seed(10 + 2718)))


def test_fork_leaves_default_stream():
    torch.manual_seed(3)
    expected = torch.rand(3)
    ts.random.model_parallel_seed(3)
    with ts.random.fork():
        torch.rand(10)
    assert torch.equal(torch.rand(3), expected)


def test_checkpoint_replays_tracked_stream():
    layer = torch.nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64)

    def block(inp):
        with ts.random.fork():
            return F.dropout(layer(inp), 0.5)

    def grad(run):
        ts.random.model_parallel_seed(1)
        layer.zero_grad()
        inp = x.clone().requires_grad_()
        run(inp).sum().backward()
        return inp.grad, layer.weight.grad.clone()

    plain = grad(block)
    replayed = grad(lambda inp: ts.random.checkpoint(block, inp))
    assert all(torch.equal(a, b) for a, b in zip(plain, replayed))


def test_errors():
    tracker = ts.random.RNGStatesTracker()
    with pytest.raises(KeyError, match="no stream 'nope'"):
        with tracker.fork("nope"):
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already used by stream 'a'"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="seed must be a non-negative int, got -1"):
        ts.random.model_parallel_seed(-1)
    with pytest.raises(ValueError, match="use_reentrant must be False"):
        ts.random.checkpoint(lambda t: t, torch.ones(1), use_reentrant=True)
