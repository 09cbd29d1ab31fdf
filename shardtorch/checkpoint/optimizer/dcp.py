"""Optimizer state in torch.distributed.checkpoint (save_dcp / load_dcp with
``optimizer=``): each state tensor an entry ``optimizer/<name>/<key>``, a
ShardedTensor placed like its parameter's shard (or a plain tensor for
replicated parameters, which DCP deduplicates), and the meta as one opaque
object under DCP_META_KEY."""
import io
from typing import Dict

import torch

from ..layout import EntryLayout
from ..sharded_tensor import as_sharded_tensor, copy_back
from .checks import checked_params, plan_on_one_rank
from .entries import optimizer_entries, plan_from_meta
from .plan import in_model_forms, load_state

DCP_META_KEY = "optimizer/__meta__"


def dcp_optimizer_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          layout: Dict[str, EntryLayout]) -> dict:
    """This rank's optimizer state as DCP entries, ready for ``dcp.save``
    beside the model's. Collective."""
    tensors, layouts, meta = optimizer_entries(model, optimizer, layout, "save_dcp", every_rank=True)
    entries = {key: as_sharded_tensor(tensor, layouts[key]) if layouts[key].sharded else tensor
               for key, tensor in tensors.items()}
    # One opaque value: DCP would flatten a dict into one entry per leaf.
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    entries[DCP_META_KEY] = buffer.getvalue()
    return entries


def load_dcp_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  checkpoint_id: str, strict: bool = True) -> dict:
    """This rank's optimizer state dict from a DCP checkpoint that save_dcp
    wrote with ``optimizer=``, at any size: every rank reads the meta, rank
    0's verdict on it decides for all, then DCP fills each rank's slices."""
    import torch.distributed.checkpoint as dcp  # at first use (checkpoint/dcp.py's doc)

    what = "load_dcp"
    box = {DCP_META_KEY: None}
    metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    if DCP_META_KEY in metadata.state_dict_metadata:
        dcp.load(box, checkpoint_id=checkpoint_id)
    meta = box[DCP_META_KEY]
    if isinstance(meta, (bytes, bytearray)):
        meta = torch.load(io.BytesIO(meta), weights_only=True)
    params = checked_params(model, optimizer, what)

    def make_plan():
        if meta is None:
            return "the checkpoint holds no optimizer state (saved without save_dcp(..., optimizer=...))"
        return plan_from_meta(params, optimizer, meta, meta["shapes"], strict)

    plan = plan_on_one_rank(0, make_plan, f"{what}: optimizer state")
    placeholders, locals_ = {}, {}

    def placeholder(entry, index, key):
        local = torch.empty(entry.local_shape, dtype=entry.dtype, device=entry.device)
        placeholders[entry.key] = as_sharded_tensor(local, entry) if entry.sharded else local
        locals_[entry.key] = (local, entry)
        return local

    result = load_state(params, plan, placeholder)
    dcp.load(placeholders, checkpoint_id=checkpoint_id)
    for key, (local, entry) in locals_.items():
        if entry.sharded:  # pieces that are not contiguous views of the shard were loaded into copies
            copy_back(placeholders[key], local, entry)
    for index, out in result["state"].items():  # DCP may replace plain tensors rather than fill them
        for key, (kind, _) in plan["state"][index].items():
            if kind == "replicated":
                out[key] = placeholders[plan["entry_keys"][index][key]]
    return in_model_forms(params, result)
