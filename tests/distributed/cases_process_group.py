"""shardtorch's process groups over their lifetime: init, re-init, destroy.
Launched with init=False: each case brings up what it needs and leaves
nothing initialised."""
import os

import torch
import torch.distributed as dist

import shardtorch as ts
from tests.doubles import _C_testing


def _reduce_ones() -> float:
    """The sum over this rank's tensor-parallel group of a 1 per rank."""
    return ts.distributed.reduce(torch.ones(1, dtype=torch.float64)).item()


def case_reinit_still_tears_down_the_torch_distributed_it_brought_up():
    world = int(os.environ["WORLD_SIZE"])
    ts.distributed.init_process_group(group_size=world)  # brings torch.distributed up
    assert dist.is_initialized()
    assert _reduce_ones() == world
    ts.distributed.init_process_group(group_size=1)  # re-init: new groups, same torch.distributed
    assert ts.distributed.get_group_size() == 1 and _reduce_ones() == 1
    ts.distributed.destroy_process_group()
    # Was: the re-init forgot that shardtorch had brought torch.distributed up.
    assert not ts.distributed.is_initialized()
    assert not dist.is_initialized(), "destroy_process_group after a re-init left torch.distributed up"


def case_reinit_leaves_the_users_torch_distributed_up():
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://")  # the user's own
    try:
        ts.distributed.init_process_group(group_size=world)
        ts.distributed.init_process_group(group_size=world)
        assert _reduce_ones() == world
        ts.distributed.destroy_process_group()
        assert not ts.distributed.is_initialized()
        assert dist.is_initialized(), "destroy_process_group tore down the user's torch.distributed"
        # Still usable by the user.
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == world
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def case_nccl_ids_travel_through_each_groups_store():
    """What an NCCL communicator's creation does first (rank 0 hands its
    ncclUniqueId to the others through the group's c10d Store, no collective
    backend involved), here with real processes and torch's own stores: every
    rank of each group gets its group rank 0's bytes, and a second exchange a
    fresh key."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    ts.distributed.init_process_group(group_size=world)
    try:
        for name in ("tp", "dp", "world"):
            first = _C_testing._share_through_group_store(name, f"{name} id from rank {rank}".encode())
            second = _C_testing._share_through_group_store(name, f"{name} again from {rank}".encode())
            group_root = ts.distributed.get_group_ranks(name)[0]
            assert first == f"{name} id from rank {group_root}".encode(), first
            assert second == f"{name} again from {group_root}".encode(), second
    finally:
        ts.distributed.destroy_process_group()


def _values(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s tensor: random, with magnitudes apart by rank so that a
    sum in another order or precision would show."""
    generator = torch.Generator().manual_seed(1000 + rank)
    if not dtype.is_floating_point:
        return torch.randint(-2**40, 2**40, (numel,), generator=generator, dtype=dtype)
    return (torch.randn(numel, generator=generator, dtype=torch.float64) * 10.0 ** rank).to(dtype)


def _transports(run) -> set:
    """Which transports ("shm" or "gloo") carried the collectives that run() makes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    # ("shm:setup": the segment's one-time setup, which the second case sees refused.)
    return {e.name.partition(":")[0] for e in prof.events()
            if e.name.partition(":")[0] in ("shm", "gloo") and e.name != "shm:setup"}


def case_small_collectives_go_through_shared_memory_exactly():
    """All-reduces and all-gathers of at most 1 MiB per rank go through the shared
    memory segment (csrc/comm/shared_memory_collectives.h), larger ones through
    Gloo; both give the plain rank-order sum and concatenation, and every rank the
    same bits."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    ts.distributed.init_process_group(group_size=world)
    try:
        # The first small CPU collective sets the segment up (a few Gloo collectives, once per group).
        ts.distributed.reduce(torch.zeros(1))
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.int64):
            slot = (1 << 20) // dtype.itemsize  # elements in one rank's slot
            for numel in (1, 1000, slot, slot + 1):
                mine = _values(rank, numel, dtype)
                expected = _values(0, numel, dtype)
                for other in range(1, world):
                    expected = expected + _values(other, numel, dtype)
                result = {}
                used = _transports(lambda: result.update(total=ts.distributed.reduce(mine.clone())))
                where = f"{dtype} x {numel}"
                assert torch.equal(result["total"], expected), where
                assert used == ({"shm"} if numel <= slot else {"gloo"}), (where, used)
                everyone = torch.cat([_values(r, numel, dtype) for r in range(world)])
                used = _transports(lambda: result.update(gathered=ts.distributed.gather(mine, dim=0)))
                assert torch.equal(result["gathered"], everyone), where
                # (A gather along dim 0 first exchanges the shards' sizes: a small collective.)
                assert (used == {"shm"}) if numel <= slot else ("gloo" in used), (where, used)
        # Tensors that differ across ranks: every rank raises, naming what each brought (Gloo refuses
        # them too), and the group goes on.
        for mine in (torch.ones(4 + rank, dtype=torch.float64),
                     torch.ones(4, dtype=torch.float64 if rank == 0 else torch.float32)):
            try:
                ts.distributed.reduce(mine)
                raise AssertionError(f"an all-reduce of {mine.dtype} x {mine.numel()} on rank {rank} passed")
            except RuntimeError as e:
                assert "every rank must bring the same size and dtype" in str(e), e
        assert torch.equal(ts.distributed.reduce(torch.ones(3)), torch.full((3,), float(world)))
        # Many in a row (the double buffer's reuse): each one's own sum.
        for step in range(50):
            total = ts.distributed.reduce(torch.full((8,), float(rank + step), dtype=torch.float64))
            assert torch.equal(total, torch.full((8,), float(sum(range(world)) + world * step),
                                                 dtype=torch.float64)), step
    finally:
        ts.distributed.destroy_process_group()


def case_shared_memory_off_on_any_rank_means_the_process_group_on_every_rank():
    """SHARDTORCH_SHARED_MEMORY=0 on one rank only: every rank agrees on Gloo
    (a rank alone in shared memory would wait for peers that never come)."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if rank == world - 1:
        os.environ["SHARDTORCH_SHARED_MEMORY"] = "0"
    try:
        ts.distributed.init_process_group(group_size=world)
        result = {}
        used = _transports(lambda: result.update(total=ts.distributed.reduce(torch.ones(4))))
        assert used == {"gloo"}, used
        assert torch.equal(result["total"], torch.full((4,), float(world)))
    finally:
        os.environ.pop("SHARDTORCH_SHARED_MEMORY", None)
        ts.distributed.destroy_process_group()
