"""This rank's optimizer state, read once and agreed on by every rank.

A ZeroRedundancyOptimizer's state is spread over its data-parallel group and
is consolidated first; any other optimizer's is its ``state_dict()``, or the
state dict the caller passes (e.g. torch.distributed.checkpoint.state_dict's
get_optimizer_state_dict, keyed by FQN). Under fully_shard (FSDP2) the state
tensors are DTensors like their parameters: each is gathered over its mesh
into what the rank would hold without fully_shard (one tensor at a time,
collective over that mesh, in index order on every rank)."""
from typing import List, Optional

import torch.distributed as dist

from ...distributed import collectives, state
from ..dtensor_entries import whole_shard
from .checks import agree, compare_descriptions, describe
from .forms import StateDictFormError, flattened_hint, indexed, is_fqn_keyed
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


def _given_state(params: OptimizerParams, given) -> tuple:
    """(the caller's state dict keyed by this optimizer's indices, or None;
    what is wrong with it, or None)."""
    if not isinstance(given, dict) or "state" not in given or "param_groups" not in given:
        return None, (f"state_dict must be this rank's optimizer state dict (a dict with 'state' and "
                      f"'param_groups'), got {type(given).__name__}{flattened_hint(given)}")
    try:
        by_name = is_fqn_keyed(given)
        local = indexed(given)
    except StateDictFormError as e:
        return None, f"state_dict: {e}"
    if len(local["param_groups"]) != len(params.groups):
        return None, (f"state_dict has {len(local['param_groups'])} parameter group(s), "
                      f"the optimizer has {len(params.groups)}")
    problems = []
    for g, (group, indices) in enumerate(zip(local["param_groups"], params.groups)):
        mine = [params.names[i] for i in indices]
        if by_name and group["param_names"] != mine:
            problems.append(f"group {g} of state_dict names parameters {group['param_names']}, "
                            f"the optimizer holds {mine}")
        elif list(group["params"]) != list(indices):
            problems.append(f"group {g} of state_dict lists ids {list(group['params'])}, "
                            f"the optimizer's state_dict() lists {list(indices)}")
    return (None, "; ".join(problems)) if problems else (local, None)


def local_and_agreed(optimizer, params: OptimizerParams, receivers: Optional[List[int]], what: str,
                     given: Optional[dict] = None):
    """This rank's state (None where it takes no part) and its description,
    after every rank has compared every rank's (collective). ``given``: the
    state dict to use instead of ``optimizer.state_dict()`` (either keying)."""
    problem = None
    if given is not None:
        if is_zero(optimizer):
            problem = ("state_dict cannot stand for a ZeroRedundancyOptimizer's state, which is spread "
                       "over its ranks; pass state_dict=None")
            local = None
        else:
            local, problem = _given_state(params, given)
    else:
        local = _local_state(optimizer, receivers)
    if local is not None:
        local = {**local, "state": {index: {key: whole_shard(value) for key, value in values.items()}
                                    for index, values in local["state"].items()}}
    description = None
    if local is not None:
        description, problem = describe(params, local)
    agree(problem, what)
    descriptions = [description]
    if dist.is_initialized() and dist.get_world_size() > 1:
        descriptions = [None] * dist.get_world_size()
        collectives.all_gather_object(descriptions, description)
    present = [(rank, d) for rank, d in enumerate(descriptions) if d is not None]
    compare_descriptions([d for _, d in present], what, [rank for rank, _ in present])
    return local, description


def tensor_parallel_group_of(rank: int) -> List[int]:
    for members in state._require("optimizer state").topology.tensor_parallel_groups():
        if rank in members:
            return list(members)
    raise ValueError(f"rank {rank} is in no tensor-parallel group")
