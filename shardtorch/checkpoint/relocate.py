"""relocate_state_dict: a full (unsharded) checkpoint, held by one rank, cut
into the shards of this model, each rank receiving only its own slices."""
from collections import OrderedDict
from typing import Optional

import torch

from ..distributed import state
from .dtensor_entries import in_model_form
from .layout import model_layout
from .transfers import broadcast_whole, scatter_slices
from .verify import broadcast_verdict, match_ddp_prefix, mismatches, shapes_of


def relocate_state_dict(model: torch.nn.Module, state_dict: Optional[dict],
                        src: int = 0) -> "OrderedDict[str, torch.Tensor]":
    """Cuts the full state dict on global rank ``src`` into this model's shards.

    Args:
        model: the sharded model (DDP-wrapped or not) that will load the result.
        state_dict: the full checkpoint on ``src`` (as saved from
            collect_state_dict or from the plain unsharded model, with or
            without DDP's "module." prefix); ignored (pass None) elsewhere.
        src: the global rank that holds the checkpoint.

    Returns this rank's state dict, ready for ``model.load_state_dict``. Every
    rank of the world calls it; ``src`` sends each rank, of every
    tensor-parallel group, only the slices that rank holds. Before any tensor
    moves, ``src`` checks the checkpoint's keys and full shapes against the
    model and broadcasts its verdict: a mismatch raises CheckpointMismatchError
    naming the keys on every rank. Under fully_shard (FSDP2) each entry the
    model holds as a DTensor is returned as one, this rank's slice of it.
    """
    world = state.get_world_size()
    if not (isinstance(src, int) and 0 <= src < world):
        raise ValueError(f"relocate_state_dict: src must be a global rank in [0, {world}), got {src!r}")
    layout = model_layout(model)
    rank = state.get_rank()
    verdict = None
    if rank == src:
        verdict = _check_on_src(state_dict, layout)
        if not isinstance(verdict, str):
            state_dict = match_ddp_prefix(state_dict, list(layout))
    payload = broadcast_verdict(verdict, src, "relocate_state_dict")
    result = OrderedDict()
    for key, entry in layout.items():
        value = state_dict[key] if rank == src else None
        if key in payload["objects"]:
            result[key] = payload["objects"][key]
        elif entry.sharded:
            result[key] = in_model_form(scatter_slices(value, entry, payload["dtypes"][key], src), entry.fsdp)
        else:
            result[key] = in_model_form(broadcast_whole(value, entry, payload["dtypes"][key], src), entry.fsdp)
    if payload["metadata"] is not None:
        result._metadata = payload["metadata"]
    return result


def _check_on_src(state_dict, layout):
    """An error message, or what the other ranks need to receive the tensors."""
    if not isinstance(state_dict, dict):
        return (f"src rank {state.get_rank()} must pass the checkpoint's state dict (a dict), "
                f"got {type(state_dict).__name__}")
    checkpoint = match_ddp_prefix(state_dict, list(layout))
    # Non-tensor entries (a module's extra state) travel with the verdict.
    objects = {k: v for k, v in checkpoint.items() if not isinstance(v, torch.Tensor)}
    problems = mismatches(shapes_of(checkpoint), {k: v for k, v in layout.items() if k not in objects})
    if problems:
        return "the checkpoint does not fit the model: " + "; ".join(problems)
    return {"dtypes": {k: v.dtype for k, v in checkpoint.items() if isinstance(v, torch.Tensor)},
            "objects": objects, "metadata": getattr(state_dict, "_metadata", None)}
