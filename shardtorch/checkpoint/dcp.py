"""torch.distributed.checkpoint (DCP) for sharded models.

DCP reshards on load when it knows where each shard sits in the full tensor.
DTensor cannot say it for shardtorch's split rule, so each shard is described
as a ShardedTensor (sharded_tensor.py): one local shard with its offsets in
the full tensor, over its tensor-parallel group. Replicated entries stay plain
tensors, which DCP deduplicates across ranks.

The ShardedTensors share storage with the model's parameters: ``dcp.load``
writes straight into them, no full tensor is ever built, and a DCP checkpoint
saved at one tensor-parallel size loads at any other. Under fully_shard
(FSDP2) the model's DTensor entries are gathered over their data-parallel
mesh first (dtensor_entries.py) and described the same way, so the checkpoint
is the same as without fully_shard; loading cuts them back. Tools that read DCP
checkpoints work on them, e.g.
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path, "m.pt")``
writes the unsharded model's state dict.

torch.distributed.checkpoint is imported at first use, not with shardtorch:
it imports torch.distributed.tensor (its cost: utils/fsdp_detection.py).
"""
from typing import Optional

import torch

from .dtensor_entries import in_model_form, whole_shard
from .layout import model_layout
from .optimizer.dcp import dcp_optimizer_entries, load_dcp_optimizer_state_dict
from .sharded_tensor import as_sharded_tensor, copy_back


def dcp_state_dict(model: torch.nn.Module, state_dict: Optional[dict] = None) -> dict:
    """``state_dict`` (default ``model.state_dict()``) with every shard wrapped
    in a ShardedTensor that tells DCP its place in the full tensor. Collective
    over the tensor-parallel groups."""
    return _described(model, model.state_dict() if state_dict is None else state_dict)[0]


def _described(model: torch.nn.Module, state_dict: dict):
    """(the entries for DCP, the tensors they hold: what the rank would hold
    without fully_shard, the layout)."""
    layout = model_layout(model, state_dict)
    plain = {key: whole_shard(tensor) for key, tensor in state_dict.items()}
    return ({key: as_sharded_tensor(tensor, layout[key]) if layout[key].sharded else tensor
             for key, tensor in plain.items()}, plain, layout)


def save_dcp(model: torch.nn.Module, checkpoint_id: str, state_dict: Optional[dict] = None,
             optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Saves ``model`` with torch.distributed.checkpoint under ``checkpoint_id``
    (collective over the world). With ``optimizer``, its state too: each state
    tensor as ``optimizer/<parameter name>/<key>``, sharded like its parameter,
    and the groups, names and scalar state as one object (``optimizer/__meta__``)."""
    wrapped = dcp_state_dict(model, state_dict)
    if optimizer is not None:
        wrapped.update(dcp_optimizer_entries(model, optimizer, model_layout(model)))
    import torch.distributed.checkpoint as dcp  # at first use (module doc)

    dcp.save(wrapped, checkpoint_id=checkpoint_id)


def load_dcp(model: torch.nn.Module, checkpoint_id: str,
             optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Loads a DCP checkpoint (from save_dcp at any tensor-parallel size) into
    ``model`` in place (collective over the world), and given ``optimizer``
    its optimizer state (saved with save_dcp(..., optimizer=...)), checked
    against the optimizer as relocate_optimizer_state_dict does. DCP raises
    on missing keys and on shape mismatches."""
    wrapped, plain, layout = _described(model, model.state_dict())
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = load_dcp_optimizer_state_dict(model, optimizer, checkpoint_id)
    import torch.distributed.checkpoint as dcp  # at first use (module doc)

    dcp.load(wrapped, checkpoint_id=checkpoint_id)
    for key, entry in layout.items():
        if entry.sharded:  # pieces that are not contiguous views of the shard were loaded into copies
            copy_back(wrapped[key], plain[key], entry)
    # Also the entries DCP replaced rather than filled in place; cut back into
    # DTensors under fully_shard.
    model.load_state_dict({key: in_model_form(plain[key] if layout[key].sharded else wrapped[key], layout[key].fsdp)
                           for key in plain})
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
