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
import io
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


def _wrap(tensor: torch.Tensor, entry) -> object:
    """A shard as a ShardedTensor that knows its place in the full tensor."""
    offsets = [0] * tensor.dim()
    offsets[entry.dim] = entry.slice_of(entry.group_rank)[0]
    device = "cpu" if tensor.device.type == "cpu" else f"{tensor.device.type}:{tensor.device.index or 0}"
    metadata = ShardMetadata(shard_offsets=offsets, shard_sizes=list(tensor.shape),
                             placement=f"rank:{dist.get_rank()}/{device}")
    return init_from_local_shards([Shard(tensor, metadata)], *entry.full_shape,
                                  process_group=state.get_group(entry.group))


def save_dcp(model: torch.nn.Module, checkpoint_id: str, state_dict: Optional[dict] = None,
             optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Saves ``model`` with torch.distributed.checkpoint under ``checkpoint_id``
    (collective over the world). With ``optimizer``, its state too: each state
    tensor as ``optimizer/<parameter name>/<key>``, sharded like its parameter,
    and the groups, names and scalar state as one object (``optimizer/__meta__``)."""
    wrapped = dcp_state_dict(model, state_dict)
    if optimizer is not None:
        from .optimizer import DCP_META_KEY, dcp_optimizer_entries
        layout = model_layout(model)
        tensors, layouts, meta = dcp_optimizer_entries(model, optimizer, layout)
        for key, tensor in tensors.items():
            wrapped[key] = _wrap(tensor, layouts[key]) if layouts[key].sharded else tensor
        # One opaque value: DCP would flatten a dict into one entry per leaf.
        buffer = io.BytesIO()
        torch.save(meta, buffer)
        wrapped[DCP_META_KEY] = buffer.getvalue()
    dcp.save(wrapped, checkpoint_id=checkpoint_id)


def load_dcp(model: torch.nn.Module, checkpoint_id: str,
             optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Loads a DCP checkpoint (from save_dcp at any tensor-parallel size) into
    ``model`` in place (collective over the world), and given ``optimizer``
    its optimizer state (saved with save_dcp(..., optimizer=...)), checked
    against the optimizer as relocate_optimizer_state_dict does. DCP raises
    on missing keys and on shape mismatches."""
    state_dict = model.state_dict()
    wrapped = dcp_state_dict(model, state_dict)
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = _load_optimizer_dcp(model, optimizer, checkpoint_id)
    dcp.load(wrapped, checkpoint_id=checkpoint_id)
    model.load_state_dict(state_dict)  # entries DCP replaced rather than filled in place
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)


def _load_optimizer_dcp(model, optimizer, checkpoint_id) -> dict:
    from .optimizer import DCP_META_KEY, _load_state, dcp_optimizer_plan
    box = {DCP_META_KEY: None}
    metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    if DCP_META_KEY in metadata.state_dict_metadata:
        dcp.load(box, checkpoint_id=checkpoint_id)
    meta = box[DCP_META_KEY]
    if isinstance(meta, (bytes, bytearray)):
        meta = torch.load(io.BytesIO(meta), weights_only=True)
    params, plan = dcp_optimizer_plan(model, optimizer, meta)
    placeholders = {}

    def placeholder(entry):
        local = torch.empty(entry.local_shape, dtype=entry.dtype, device=entry.device)
        placeholders[entry.key] = _wrap(local, entry) if entry.sharded else local
        return local

    results = _load_state(params, plan, placeholder)
    dcp.load(placeholders, checkpoint_id=checkpoint_id)
    for index, out in results.items():  # DCP may replace plain tensors rather than fill them
        for key, (kind, _) in plan["state"][index].items():
            if kind == "replicated":
                out[key] = placeholders[plan["entry_keys"][index][key]]
    return {"state": results, "param_groups": plan["param_groups"]}
