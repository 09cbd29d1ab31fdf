"""collect_state_dict: a sharded model's state dict as the unsharded model's."""
from collections import OrderedDict
from typing import Optional

import torch

from ..distributed import state
from .dtensor_entries import whole_shard
from .layout import model_layout
from .transfers import gather_everywhere, gather_to
from .verify import agree_on_problems, strip_ddp_prefix


def collect_state_dict(model: torch.nn.Module, state_dict: dict,
                       dst: Optional[int] = None) -> Optional["OrderedDict[str, torch.Tensor]"]:
    """Gathers the shards of ``state_dict`` (``model.state_dict()``) into the
    full tensors of the unsharded model: same keys, same shapes, loadable into
    the plain torch model.

    Args:
        model: the sharded model (DDP-wrapped or not) that produced ``state_dict``.
        state_dict: its state dict (keys as ``model.state_dict()`` names them).
        dst: None: every rank receives the full state dict (each tensor-parallel
            group gathers its own shards, every member holding the result plus
            at most one shard in flight). A global rank: only ``dst`` receives
            it, gathered from the tensor-parallel group that contains ``dst``;
            ranks of other tensor-parallel groups (data-parallel replicas) take
            no part in the transfer. Ranks other than ``dst`` return None.

    Collective: every rank of the world calls it. With ``dst`` given, ``dst``
    holds the full state dict it returns plus at most one full tensor in
    flight; the other ranks hold only their shards. Under fully_shard (FSDP2)
    the entries are DTensors: each is first gathered over its data-parallel
    mesh (one entry at a time), and the result holds plain full tensors.
    """
    world = state.get_world_size()
    if dst is not None and not (isinstance(dst, int) and 0 <= dst < world):
        raise ValueError(f"collect_state_dict: dst must be None or a global rank in [0, {world}), got {dst!r}")
    _check_against_model(model, state_dict)
    layout = model_layout(model, state_dict)
    rank = state.get_rank()
    receives = dst is None or rank == dst
    result = OrderedDict() if receives else None
    for key, tensor in state_dict.items():
        entry = layout[key]
        tensor = whole_shard(tensor)  # under fully_shard: collective over its mesh, on every rank
        if not entry.sharded:
            if receives:
                result[key] = tensor
            continue
        if dst is None:
            full = gather_everywhere(tensor, entry)
        else:
            full = gather_to(tensor, entry, dst)
        if receives:
            result[key] = full
    if receives and hasattr(state_dict, "_metadata"):
        result._metadata = state_dict._metadata
    return result


def _check_against_model(model: torch.nn.Module, state_dict: dict) -> None:
    """Every rank compares its state dict with its model (keys, local shapes)
    and all of them learn every rank's verdict before any tensor moves, so a
    mismatch on one rank is an error on all, never a wrong gather or a hang."""
    expected = {strip_ddp_prefix(key): tuple(value.shape) for key, value in model.state_dict().items()
                if torch.is_tensor(value)}
    given = {strip_ddp_prefix(key): value for key, value in state_dict.items() if torch.is_tensor(value)}
    problems = [f"missing key {key!r}" for key in expected if key not in given]
    problems += [f"unexpected key {key!r}" for key in given if key not in expected]
    problems += [f"{key!r} has shape {tuple(value.shape)}, this rank's model holds {expected[key]}"
                 for key, value in given.items() if key in expected and tuple(value.shape) != expected[key]]
    agree_on_problems("; ".join(problems) or None,
                      "collect_state_dict: the state dict does not match the model: ")
