"""Topology and shard arithmetic (csrc/topology), checked against the rules
stated in DESIGN.md, without processes."""
import itertools

import pytest

from shardtorch import _C


@pytest.mark.parametrize("total,parts", list(itertools.product([0, 1, 5, 7, 8, 1000001, 13], [1, 2, 3, 4, 8])))
def test_shards_partition_the_range(total, parts):
    sizes = _C.shard_sizes(total, parts)
    assert sum(sizes) == total
    # The first total % parts ranks hold one more; the rest hold total // parts.
    assert sizes == [total // parts + (1 if r < total % parts else 0) for r in range(parts)]
    offsets = [_C.shard_offset(total, parts, r) for r in range(parts)]
    assert offsets == [sum(sizes[:r]) for r in range(parts)]
    assert [_C.shard_size(total, parts, r) for r in range(parts)] == sizes


def test_million_classes_over_eight_ranks():
    sizes = _C.shard_sizes(1_000_001, 8)
    assert sizes == [125001] + [125000] * 7


@pytest.mark.parametrize("bad", [(5, 0, 0), (5, 2, 2), (5, 2, -1), (-1, 2, 0)])
def test_bad_split_arguments_are_refused(bad):
    with pytest.raises(RuntimeError, match="shard_size"):
        _C.shard_size(*bad)


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (6, 3)])
def test_groups_cover_the_world_once(world, tp):
    groups = _C.TensorParallelTopology(world, 0, tp)
    tp_groups, dp_groups = groups.tensor_parallel_groups(), groups.data_parallel_groups()
    assert len(tp_groups) == world // tp and len(dp_groups) == tp
    assert sorted(r for g in tp_groups for r in g) == list(range(world))
    assert sorted(r for g in dp_groups for r in g) == list(range(world))
    for g in tp_groups:  # consecutive ranks, so a group shares a node
        assert g == list(range(g[0], g[0] + tp))
    for t, g in enumerate(dp_groups):
        assert g == list(range(t, world, tp))
    for rank in range(world):
        topo = _C.TensorParallelTopology(world, rank, tp)
        assert rank in topo.tensor_parallel_group_ranks() and rank in topo.data_parallel_group_ranks()
        assert topo.tensor_parallel_group_ranks()[topo.tensor_parallel_rank] == rank
        assert topo.data_parallel_group_ranks()[topo.data_parallel_rank] == rank
        assert topo.data_parallel_size == world // tp


@pytest.mark.parametrize("world,rank,tp,fragment", [(4, 0, 3, "must divide the world size 4, got 3"),
                                                    (4, 4, 2, "rank must be in [0, 4)"),
                                                    (4, 0, 0, "group_size must divide")])
def test_bad_topology_is_refused(world, rank, tp, fragment):
    with pytest.raises(RuntimeError) as info:
        _C.TensorParallelTopology(world, rank, tp)
    assert fragment in str(info.value)
