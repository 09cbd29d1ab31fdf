"""torch.distributed.checkpoint (DCP) for sharded models.

DCP reshards on load when it knows where each shard sits in the full tensor.
DTensor cannot say it for shardtorch's split rule (the first n % size ranks
hold one more; DTensor's Shard(dim) follows torch.chunk instead), so each
shard is described as a ShardedTensor: one local shard with its offsets in the
full tensor, over its tensor-parallel group. Replicated entries stay plain
tensors, which DCP deduplicates across ranks.

The ShardedTensors share storage with the model's parameters: ``dcp.load``
writes straight into them, no full tensor is ever built, and a DCP checkpoint
saved at one tensor-parallel size loads at any other. Tools that read DCP
checkpoints work on them, e.g.
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path, "m.pt")``
writes the unsharded model's state dict.
"""
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

from ..distributed import state
from .layout import model_layout


def dcp_state_dict(model: torch.nn.Module, state_dict: Optional[dict] = None) -> dict:
    """``state_dict`` (default ``model.state_dict()``) with every shard wrapped
    in a ShardedTensor that tells DCP its place in the full tensor. Collective
    over the tensor-parallel groups."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    layout = model_layout(model, state_dict)
    rank = dist.get_rank()
    wrapped = {}
    for key, tensor in state_dict.items():
        entry = layout[key]
        if not entry.sharded:
            wrapped[key] = tensor
            continue
        offsets = [0] * tensor.dim()
        offsets[entry.dim] = entry.slice_of(entry.group_rank)[0]
        device = "cpu" if tensor.device.type == "cpu" else f"{tensor.device.type}:{tensor.device.index or 0}"
        metadata = ShardMetadata(shard_offsets=offsets, shard_sizes=list(tensor.shape),
                                 placement=f"rank:{rank}/{device}")
        wrapped[key] = init_from_local_shards([Shard(tensor, metadata)], *entry.full_shape,
                                              process_group=state.get_group(entry.group))
    return wrapped


def save_dcp(model: torch.nn.Module, checkpoint_id: str, state_dict: Optional[dict] = None) -> None:
    """Saves ``model`` with torch.distributed.checkpoint under ``checkpoint_id``
    (collective over the world)."""
    dcp.save(dcp_state_dict(model, state_dict), checkpoint_id=checkpoint_id)


def load_dcp(model: torch.nn.Module, checkpoint_id: str) -> None:
    """Loads a DCP checkpoint (from save_dcp at any tensor-parallel size) into
    ``model`` in place (collective over the world). DCP raises on missing keys
    and on shape mismatches."""
    state_dict = model.state_dict()
    dcp.load(dcp_state_dict(model, state_dict), checkpoint_id=checkpoint_id)
    model.load_state_dict(state_dict)  # entries DCP replaced rather than filled in place
