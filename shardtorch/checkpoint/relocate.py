"""relocate_state_dict: a full (unsharded) checkpoint, held by one rank, cut
into the shards of this model, each rank receiving only its own slices."""
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import state
from .dtensor_entries import in_model_form
from .layout import EntryLayout, model_layout
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
            result[key] = in_model_form(_scatter_slices(value, entry, payload["dtypes"][key], src), entry.fsdp)
        else:
            result[key] = in_model_form(_broadcast(value, entry, payload["dtypes"][key], src), entry.fsdp)
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


def _scatter_slices(full: Optional[torch.Tensor], entry: EntryLayout, dtype: torch.dtype,
                    src: int) -> torch.Tensor:
    """Every rank receives its slice of ``full`` from ``src``: each slice is
    made contiguous once and sent to the ranks of every tensor-parallel group
    that hold it, so ``src`` holds at most one slice beyond the checkpoint."""
    rank = state.get_rank()
    device = entry.device
    if rank == src:
        mine = None
        for group_rank, ranks in enumerate(_ranks_by_group_rank(entry.group)):
            offset, length = entry.slice_of(group_rank)
            piece = full.narrow(entry.dim, offset, length).to(device).contiguous()
            for peer in ranks:
                if peer == rank:
                    # Own a copy rather than a view that would keep the whole
                    # checkpoint tensor alive as long as the result.
                    shares = piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
                    mine = piece.clone() if shares else piece
                elif piece.numel() > 0:
                    dist.send(piece, peer)
            del piece
        return mine
    buffer = torch.empty(entry.local_shape, dtype=dtype, device=device)
    if buffer.numel() > 0:
        dist.recv(buffer, src)
    return buffer


def _broadcast(full: Optional[torch.Tensor], entry: EntryLayout, dtype: torch.dtype,
               src: int) -> torch.Tensor:
    rank = state.get_rank()
    if rank == src:
        tensor = full.to(entry.device).contiguous()
    else:
        tensor = torch.empty(entry.full_shape, dtype=dtype, device=entry.device)
    if state.get_world_size() > 1 and tensor.numel() > 0:
        dist.broadcast(tensor, src)
    return tensor


def _ranks_by_group_rank(group: str):
    """Global ranks that hold group rank r of ``group``, for r = 0, 1, ...: the
    r-th member of every group of that kind (every tensor-parallel group, or
    the one world group)."""
    if group == state.WORLD:
        return [[r] for r in range(state.get_world_size())]
    if group != state.TENSOR_PARALLEL:
        raise NotImplementedError(f"relocate_state_dict: entries sharded over group {group!r} are not "
                                  f"supported; only {state.TENSOR_PARALLEL!r} and {state.WORLD!r}")
    groups = state._require("relocate_state_dict").topology.tensor_parallel_groups()
    return [[members[r] for members in groups] for r in range(state.get_group_size(group))]
