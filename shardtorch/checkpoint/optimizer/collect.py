"""collect_optimizer_state_dict: the optimizer state of a sharded model as
the same optimizer over the unsharded model holds it."""
from typing import Dict, Optional

import torch

from ...distributed import state
from ..transfers import gather_everywhere, gather_to
from .checks import check_optimizer_kind
from .forms import fqn_keyed
from .local import local_and_agreed, tensor_parallel_group_of
from .params import SPLIT_KINDS, OptimizerParams, split_state_entry


def collect_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                 dst: Optional[int] = None, *, fqn_keys: bool = False,
                                 state_dict: Optional[dict] = None) -> Optional[dict]:
    """The state dict the same optimizer over the unsharded model would hold.

    Args:
        model: the sharded model (DDP-wrapped or not) whose parameters
            ``optimizer`` updates.
        optimizer: a torch optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...)
            over the model's parameters (all of them or some).
        dst: None: every rank receives the result. A global rank: only ``dst``
            does (gathered from its tensor-parallel group; other ranks return None).
        fqn_keys: False: keyed like ``optimizer.state_dict()`` (integer ids).
            True: keyed like torch.distributed.checkpoint.state_dict's
            get_optimizer_state_dict (``state`` by parameter FQN, FQN lists in
            ``params``), which its set_optimizer_state_dict loads into the
            unsharded model's optimizer.
        state_dict: this rank's optimizer state dict to collect instead of
            ``optimizer.state_dict()``, keyed either way (e.g. what
            ``get_optimizer_state_dict(model, optimizer)`` returns for the
            sharded model: FQN-keyed shards). Not for a ZeroRedundancyOptimizer.

    Returns ``{"state", "param_groups"}`` keyed like ``optimizer.state_dict()``,
    each group carrying ``param_names`` (the unsharded model's names), ready for
    ``torch.optim.X(plain_model.parameters()).load_state_dict``; or the FQN form.

    Collective over the world. Before any tensor moves, every rank's optimizer
    is compared (groups, names, state keys and kinds): a difference raises
    OptimizerStateMismatchError on every rank. ``dst`` holds the result plus
    at most one full tensor in flight; other ranks hold only their shards.
    """
    what = "collect_optimizer_state_dict"
    world = state.get_world_size()
    if dst is not None and not (isinstance(dst, int) and 0 <= dst < world):
        raise ValueError(f"{what}: dst must be None or a global rank in [0, {world}), got {dst!r}")
    check_optimizer_kind(optimizer, what)
    params = OptimizerParams(model, optimizer)
    params.read_layout(model)
    local, description = local_and_agreed(optimizer, params, None if dst is None else tensor_parallel_group_of(dst),
                                          what, given=state_dict)
    rank = state.get_rank()
    receives = dst is None or rank == dst
    if local is None:  # a ZeroRedundancyOptimizer's rank outside dst's tensor-parallel group
        return None
    collected: Dict[int, dict] = {}
    for index in range(len(params.params)):
        kinds = description["state"].get(params.names[index])
        if kinds is None:
            continue
        out = {}
        for key, value in local["state"][index].items():
            kind = kinds[str(key)][0]
            if kind not in SPLIT_KINDS:
                out[key] = value
                continue
            entry = split_state_entry(params.entry(index), kind, f"{params.names[index]}:{key}",
                                      value.dtype, value.device)
            full = gather_everywhere(value, entry) if dst is None else gather_to(value, entry, dst)
            if receives:
                out[key] = full
        if receives:
            collected[index] = out
    if not receives:
        return None
    result = {"state": collected, "param_groups": params.named_groups(local["param_groups"], with_indices=True)}
    return fqn_keyed(result) if fqn_keys else result
