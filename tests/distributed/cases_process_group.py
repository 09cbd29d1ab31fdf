"""shardtorch's process groups over their lifetime: init, re-init, destroy.
Launched with init=False: each case brings up what it needs and leaves
nothing initialised."""
import os

import torch
import torch.distributed as dist

import shardtorch as ts


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
            first = ts._C._share_through_group_store(name, f"{name} id from rank {rank}".encode())
            second = ts._C._share_through_group_store(name, f"{name} again from {rank}".encode())
            group_root = ts.distributed.get_group_ranks(name)[0]
            assert first == f"{name} id from rank {group_root}".encode(), first
            assert second == f"{name} again from {group_root}".encode(), second
    finally:
        ts.distributed.destroy_process_group()
