"""This rank's optimizer state, read once and agreed on by every rank.

A ZeroRedundancyOptimizer's state is spread over its data-parallel group and
is consolidated first; any other optimizer's is its ``state_dict()``."""
from typing import List, Optional

import torch.distributed as dist

from ...distributed import state
from .checks import compare_descriptions, describe, agree
from .params import OptimizerParams, is_zero


def _local_state(optimizer, receivers: Optional[List[int]]) -> Optional[dict]:
    """This rank's optimizer.state_dict(), or None on ranks that take no part.

    A ZeroRedundancyOptimizer's state is consolidated (collective over every
    data-parallel group) on the members of ``receivers`` (global ranks, one
    tensor-parallel group: each data-parallel group holds one of them), or on
    every rank when None; ranks not consolidated to return None."""
    if not is_zero(optimizer):
        return optimizer.state_dict()
    members = dist.get_process_group_ranks(optimizer.process_group)
    targets = range(len(members)) if receivers is None else \
        [i for i, r in enumerate(members) if r in receivers]
    mine = None
    for target in targets:
        optimizer.consolidate_state_dict(to=target)
        if members[target] == state.get_rank():
            mine = optimizer.state_dict()
        optimizer._all_state_dicts = []  # drop the consolidated copy (ours is referenced by mine)
    return mine


def local_and_agreed(optimizer, params: OptimizerParams, receivers: Optional[List[int]], what: str):
    """This rank's state (None where it takes no part) and its description,
    after every rank has compared every rank's (collective)."""
    problem = None
    local = _local_state(optimizer, receivers)
    description = None
    if local is not None:
        description, problem = describe(params, local)
    agree(problem, what)
    descriptions = [description]
    if dist.is_initialized() and dist.get_world_size() > 1:
        descriptions = [None] * dist.get_world_size()
        dist.all_gather_object(descriptions, description)
    present = [(rank, d) for rank, d in enumerate(descriptions) if d is not None]
    compare_descriptions([d for _, d in present], what, [rank for rank, _ in present])
    return local, description


def tensor_parallel_group_of(rank: int) -> List[int]:
    for members in state._require("optimizer state").topology.tensor_parallel_groups():
        if rank in members:
            return list(members)
    raise ValueError(f"rank {rank} is in no tensor-parallel group")
