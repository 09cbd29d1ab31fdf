"""relocate_optimizer_state_dict: a full optimizer state, held by one rank,
cut into this rank's shards."""
from typing import Optional

import torch

from ...distributed import state
from ..transfers import broadcast_whole, scatter_slices
from .checks import checked_params, plan_on_one_rank
from .forms import indexed
from .plan import in_model_forms, load_state, plan_from_full_state


def relocate_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state_dict: Optional[dict], src: int = 0, strict: bool = True) -> dict:
    """Cuts a full optimizer state dict on global rank ``src`` into this rank's
    shards; returns what ``optimizer.load_state_dict`` takes (and what
    torch.distributed.checkpoint.state_dict's set_optimizer_state_dict takes).

    Args:
        model: the sharded model (DDP-wrapped or not) whose parameters
            ``optimizer`` updates.
        optimizer: the optimizer that will load the result (same class and
            parameter groups as the one that saved it).
        state_dict: on ``src``, the full state (from collect_optimizer_state_dict
            at any size, or ``state_dict()`` of the same optimizer over the plain
            unsharded model, or torch.distributed.checkpoint.state_dict's
            get_optimizer_state_dict of it, keyed by FQN); ignored elsewhere (pass None).
        src: the global rank that holds it.
        strict: a parameter that requires grad but has no state, while others
            of its group have some, is an error (partial state).

    Parameters are matched by name when the state names them (FQN keys, or
    ``param_names``: collected state does; torch's does for optimizers built
    from named parameters), else by position as torch does. Hyperparameters
    (lr, ...) come from the state dict, as with torch's load_state_dict.
    Collective over the world: ``src`` checks the state against this optimizer
    and the model (groups, names, the optimizer class, state keys, full shapes)
    and broadcasts its verdict, so a mismatch raises
    OptimizerStateMismatchError on every rank naming what differs; then each
    rank receives only its slices.
    """
    what = "relocate_optimizer_state_dict"
    world = state.get_world_size()
    if not (isinstance(src, int) and 0 <= src < world):
        raise ValueError(f"{what}: src must be a global rank in [0, {world}), got {src!r}")
    params = checked_params(model, optimizer, what)
    plan = plan_on_one_rank(src, lambda: plan_from_full_state(params, optimizer, state_dict, strict), what)
    full_state = indexed(state_dict)["state"] if state.get_rank() == src else None

    def receive(entry, index, key):
        full = full_state[plan["saved_index"][index]][key] if full_state is not None else None
        send = scatter_slices if entry.sharded else broadcast_whole
        tensor = send(full, entry, entry.dtype, src)
        if full is not None and tensor.numel() and tensor.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
            # src's own copy: the optimizer updates its state in place, and the
            # given one may be the live state of another optimizer (collected in this process).
            tensor = tensor.clone()
        return tensor

    return in_model_forms(params, load_state(params, plan, receive))
