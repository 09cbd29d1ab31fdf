"""DistributedGroupSampler partitions, checked exhaustively without processes
(explicit num_replicas = data-parallel size, rank = data-parallel rank)."""
import itertools
import math

import pytest

import shardtorch as ts
from shardtorch.utils.data import DistributedGroupSampler


def _replica_indices(n, replicas, rank, shuffle, drop_last, epoch, seed=5):
    sampler = DistributedGroupSampler(list(range(n)), num_replicas=replicas, rank=rank, shuffle=shuffle,
                                      seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    indices = list(sampler)
    assert len(indices) == len(sampler)
    return indices


@pytest.mark.parametrize("world,group_size", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 2), (8, 2)])
def test_partition(world, group_size):
    replicas = world // group_size
    for n, shuffle, drop_last, epoch in itertools.product((0, 1, 5, 7, 12, 23), (False, True), (False, True),
                                                          (0, 1, 2)):
        # Every rank of a tensor-parallel group (global ranks g*size .. g*size+size-1,
        # data-parallel rank g) builds the sampler with its data-parallel rank.
        per_rank = [_replica_indices(n, replicas, rank // group_size, shuffle, drop_last, epoch)
                    for rank in range(world)]
        per_group = per_rank[::group_size]
        for rank in range(world):
            assert per_rank[rank] == per_group[rank // group_size], "ranks of one group differ"
        length = n // replicas if drop_last else math.ceil(n / replicas)
        assert all(len(indices) == length for indices in per_group)
        flat = [i for indices in per_group for i in indices]
        assert all(0 <= i < n for i in flat)
        if drop_last or n % replicas == 0:  # disjoint
            assert len(set(flat)) == len(flat), (n, replicas, shuffle, drop_last)
            assert len(flat) == length * replicas
        else:  # every sample, padded with the fewest repeats
            assert set(flat) == set(range(n))
            assert len(flat) - len(set(flat)) == length * replicas - n
        if not shuffle:
            assert per_group[0][:1] == ([0] if length else [])
        # Same epoch reproduces; a shuffled new epoch permutes differently.
        again = _replica_indices(n, replicas, 0, shuffle, drop_last, epoch)
        assert again == per_group[0]


def test_epochs_reshuffle():
    a = _replica_indices(50, 2, 0, True, False, 0)
    b = _replica_indices(50, 2, 0, True, False, 1)
    assert a != b
    assert a == _replica_indices(50, 2, 0, True, False, 0)


def test_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"rank must be in \[0, num_replicas=2\).*got 2"):
        DistributedGroupSampler(list(range(4)), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas must be a positive int.*got 0"):
        DistributedGroupSampler(list(range(4)), num_replicas=0, rank=0)
    # Without shardtorch's groups (whatever other tests of the session set up).
    monkeypatch.setattr(ts.distributed.state, "_state", None)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedGroupSampler(list(range(4)))
    assert ts.utils.data.DistributedGroupSampler is DistributedGroupSampler
