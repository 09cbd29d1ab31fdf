"""shardtorch/distributed/collectives.py, the package's one collective layer, on real ranks: each
call gives torch.distributed's result over every kind of group it may be given (a shardtorch name,
its ProcessGroup, None for the world), with torch.distributed's global ranks for src and dst, and
goes through the shard ops' communicators (seen by the shared-memory transport that only they have)."""
import os
import tempfile
import time

import torch
import torch.distributed as dist

import shardtorch as ts
from shardtorch.distributed import collectives
from shardtorch.distributed import state
from tests.distributed.harness import scratch_dir


def _value(rank: int, shape=(2, 3)) -> torch.Tensor:
    """Global rank ``rank``'s tensor: apart by rank, so a wrong source or order shows."""
    return torch.arange(6, dtype=torch.float64).view(shape) + 100.0 * rank


def _groups():
    """(how the group is given, its global ranks) for each way to name each group."""
    for name in (state.TENSOR_PARALLEL, state.DATA_PARALLEL, state.WORLD):
        ranks = ts.distributed.get_group_ranks(name)
        yield name, ranks
        yield state.get_group(name), ranks
    yield None, list(range(ts.distributed.get_world_size()))


def case_tensor_collectives_give_torch_distributeds_results():
    rank = ts.distributed.get_rank()
    for group, ranks in _groups():
        where = f"group {group!r} (ranks {ranks})"
        total = _value(rank)
        collectives.all_reduce(total, group=group)
        assert torch.equal(total, sum(_value(r) for r in ranks)), where
        largest = _value(rank)
        collectives.all_reduce(largest, op="max", group=group)
        assert torch.equal(largest, _value(max(ranks))), where
        everyone = [torch.empty(2, 3, dtype=torch.float64) for _ in ranks]
        collectives.all_gather(everyone, _value(rank), group=group)
        assert all(torch.equal(t, _value(r)) for t, r in zip(everyone, ranks)), where
        for source in ranks:
            got = _value(rank)
            collectives.broadcast(got, source, group=group)
            assert torch.equal(got, _value(source)), (where, source)
        # Dtypes NCCL lacks travel as bytes.
        flags = torch.tensor([rank % 2 == 0, True, rank == ranks[-1]])
        collectives.broadcast(flags, ranks[-1], group=group)
        assert flags.tolist() == [ranks[-1] % 2 == 0, True, True], (where, flags)
        waves = [torch.empty(2, dtype=torch.complex64) for _ in ranks]
        collectives.all_gather(waves, torch.tensor([rank, 1j * rank], dtype=torch.complex64), group=group)
        assert [w.tolist() for w in waves] == [[complex(r), 1j * r] for r in ranks], where
        # In place into a view that is not contiguous: the view's elements change, nothing else.
        base = _value(rank, (3, 2))
        collectives.all_reduce(base.t(), group=group)
        assert torch.equal(base, sum(_value(r, (3, 2)) for r in ranks)), where


def case_point_to_point_takes_global_ranks():
    rank, world = ts.distributed.get_rank(), ts.distributed.get_world_size()
    for group, ranks in _groups():
        if len(ranks) == 1:
            continue
        position = ranks.index(rank)
        after, before = ranks[(position + 1) % len(ranks)], ranks[position - 1]
        got = torch.empty(2, 3, dtype=torch.float64)
        # Even positions send first, odd ones receive first: no two ranks wait on each other.
        if position % 2 == 0:
            collectives.send(_value(rank), after, group=group)
            collectives.recv(got, before, group=group)
        else:
            collectives.recv(got, before, group=group)
            collectives.send(_value(rank), after, group=group)
        assert torch.equal(got, _value(before)), (group, ranks)
    assert world == len(ts.distributed.get_group_ranks(state.WORLD))


def case_object_collectives_carry_any_picklable_value():
    rank = ts.distributed.get_rank()
    for group, ranks in _groups():
        values = [None] * len(ranks)
        mine = {"rank": rank, "text": "x" * (10 * rank + 1), "none": None}  # lengths differ by rank
        collectives.all_gather_object(values, mine, group=group)
        assert values == [{"rank": r, "text": "x" * (10 * r + 1), "none": None} for r in ranks], (group, values)
        box = [f"from {rank}", rank]
        collectives.broadcast_object_list(box, src=ranks[-1], group=group)
        assert box == [f"from {ranks[-1]}", ranks[-1]], (group, box)


def case_barrier_waits_for_every_rank():
    """Rank 0 writes a file late, then joins the barrier: every rank finds it after its own barrier."""
    for index, (group, ranks) in enumerate(_groups()):
        marker = os.path.join(scratch_dir(), f"barrier-{ts.distributed.get_world_size()}-{index}-{ranks[0]}")
        if ts.distributed.get_rank() == ranks[0]:
            time.sleep(0.2)
            with tempfile.NamedTemporaryFile("w", dir=scratch_dir(), delete=False) as f:
                f.write("here")
            os.replace(f.name, marker)
        collectives.barrier(group=group)
        assert os.path.exists(marker), (group, ranks)


def case_they_go_through_the_shard_ops_communicators():
    """The shared-memory segment (small CPU tensors, ranks of one host) belongs to csrc/comm's
    communicators alone: a collective torch.distributed made itself would show as Gloo's."""
    from torch.profiler import ProfilerActivity, profile
    collectives.all_reduce(torch.zeros(1), group="tp")  # the segment's one-time setup
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        total = torch.ones(4)
        collectives.all_reduce(total, group=state.get_group("tp"))
        everyone = [torch.empty(4) for _ in range(ts.distributed.get_group_size())]
        collectives.all_gather(everyone, torch.ones(4), group="tp")
    names = {e.name for e in prof.events()}
    assert {"shm:all_reduce", "shm:all_gather"} <= names, sorted(n for n in names if ":" in n)
    assert not any(n.startswith("gloo:") for n in names), sorted(n for n in names if ":" in n)
    assert torch.equal(total, torch.full((4,), float(ts.distributed.get_group_size())))


def case_groups_shardtorch_does_not_know_go_to_torch_distributed():
    world = ts.distributed.get_world_size()
    mine = dist.new_group(list(range(world)))  # never registered: torch.distributed carries it
    try:
        total = torch.ones(3)
        collectives.all_reduce(total, group=mine)
        assert torch.equal(total, torch.full((3,), float(world)))
        values = [None] * world
        collectives.all_gather_object(values, os.environ["RANK"], group=mine)
        assert values == [str(r) for r in range(world)], values
    finally:
        dist.destroy_process_group(mine)
    try:
        collectives.all_reduce(torch.ones(1), group="no such group")
        raise AssertionError("an unknown group name passed")
    except ValueError as error:
        assert "unknown group 'no such group'" in str(error), error
