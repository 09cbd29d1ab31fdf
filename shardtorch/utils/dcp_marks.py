"""State-dict entries that tell torch.distributed.checkpoint where they sit in the whole tensor.

torch's ``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` / ``dcp.load``
(what torchtitan and the rest of the ecosystem use) treat a plain tensor as a
replicated one: each rank's shard of a parallel layer would be saved under the
same key as if all were copies of one tensor, and DCP would keep one rank's.
torch (2.14 and later) reads four attributes of a plain tensor as its place
in the whole (``torch.distributed.checkpoint.protocol.CheckpointableTensor``):
the whole shape, and per piece its offsets in the whole and in the local
tensor and its sizes. A rank may hold several pieces (heads from each part of
a fused q/k/v projection), so each piece is described.

So every module that records a shard (``register_shard``) gets a state-dict
hook that sets these attributes on its sharded entries (each call of
``state_dict()`` makes new tensor objects), and every optimizer that steps
parameters which are shards gets a state-dict hook that sets them on the
state tensors of those parameters (momentum, Adam's moments), found through
the parameters' shard facts. DCP then saves each piece once, under its offsets,
and loads any group size's pieces from any other's: resharding is DCP's own.
With an older torch the attributes are set and ignored; ``ts.checkpoint.save_dcp``
works there (it describes the same pieces as ShardedTensors).

Under torch's ``full_state_dict=True`` the same hooks put whole tensors in the
state dict, and take this rank's pieces of whole tensors on load
(torch_state_dict.py).
"""
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

from .shard_specs import registered_shards
from .torch_state_dict import (full_state_dict_requested, gather_whole, is_whole_of, local_pieces,
                               refuse_under_fully_shard)


class _ByIdentity:
    """{tensor: value} by identity, holding the tensors weakly (a tensor's == is element-wise, so
    WeakKeyDictionary cannot key by it)."""

    def __init__(self):
        self._items = {}

    def __setitem__(self, tensor, value):
        key = id(tensor)
        self._items[key] = (weakref.ref(tensor, lambda _, key=key: self._items.pop(key, None)), value)

    def get(self, tensor, default=None):
        item = self._items.get(id(tensor))
        return item[1] if item is not None and item[0]() is tensor else default


_PARAMETERS = _ByIdentity()  # parameter -> its ShardSpec
_HOOKED = "_shardtorch_dcp_marks"
_optimizer_hook_installed = False


def mark(tensor: torch.Tensor, full_shape: Sequence[int], dim: int, pieces: List[Tuple[int, int]]) -> None:
    """Sets the CheckpointableTensor attributes of ``tensor``, which holds
    ``pieces`` [(offset, length)] along ``dim`` of a tensor of ``full_shape``."""
    global_offsets, local_offsets, local_sizes = [], [], []
    at = 0
    for offset, length in pieces:
        if length == 0:
            continue
        whole = [0] * len(full_shape)
        whole[dim] = offset
        local = [0] * len(full_shape)
        local[dim] = at
        size = list(full_shape)
        size[dim] = length
        global_offsets.append(tuple(whole))
        local_offsets.append(tuple(local))
        local_sizes.append(tuple(size))
        at += length
    tensor.global_shape = tuple(full_shape)
    tensor.global_offsets = tuple(global_offsets)
    tensor.local_offsets = tuple(local_offsets)
    tensor.local_sizes = tuple(local_sizes)


def _place(tensor: torch.Tensor, spec) -> Optional[tuple]:
    """(full shape, split dim, pieces) of ``tensor``, this rank's shard under ``spec``; None when not known."""
    from ..distributed import state
    from .fsdp_detection import is_dtensor
    if spec.full_size is None or is_dtensor(tensor) or tensor.dim() <= spec.dim:
        return None
    full = list(tensor.shape)
    full[spec.dim] = spec.full_size
    pieces = spec.pieces(spec.full_size, state.get_group_size(spec.group), state.get_group_rank(spec.group))
    if sum(length for _, length in pieces) != tensor.shape[spec.dim]:
        return None
    return tuple(full), spec.dim, pieces


def _mark_module_entries(module, state_dict, prefix, local_metadata) -> None:
    full = None
    for name, spec in registered_shards(module).items():
        param = module._parameters.get(name)
        if param is not None:
            _PARAMETERS[param] = spec
        entry = state_dict.get(prefix + name)
        if isinstance(entry, torch.Tensor):
            refuse_under_fully_shard(prefix + name, entry, spec)
            place = _place(entry, spec)
            if place is None:
                continue
            full = full_state_dict_requested() if full is None else full
            if full:
                state_dict[prefix + name] = gather_whole(entry, spec, place)
            else:
                mark(entry, *place)


def _mark_optimizer_state(optimizer, state_dict) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    full = None
    for index, values in (state_dict.get("state") or {}).items():
        # ZeroRedundancyOptimizer's consolidated state holds None for what it did not gather.
        if not isinstance(index, int) or index >= len(params) or not isinstance(values, dict):
            continue
        param = params[index]
        spec = _PARAMETERS.get(param)
        if spec is None:
            continue
        refuse_under_fully_shard(f"the optimizer state of parameter {index}", param, spec)
        place = _place(param, spec)
        if place is None:
            continue
        full = full_state_dict_requested() if full is None else full
        if full:
            # A new dict: torch's state_dict() hands out the optimizer's own state dicts.
            state_dict["state"][index] = {
                key: gather_whole(value, spec, place) if _is_state_of(value, param) else value
                for key, value in values.items()}
            continue
        for value in values.values():
            if _is_state_of(value, param):
                mark(value, *place)


def _is_state_of(value, param) -> bool:
    """Whether an optimizer state value is shaped as its parameter (momentum, Adam's moments)."""
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)


def _take_pieces_of_module_entries(module, state_dict, prefix, *args) -> None:
    """load_state_dict of a whole tensor where this rank holds a shard (torch's set_state_dict with
    full_state_dict=True gives whole tensors): this rank's pieces are taken from it."""
    for name, spec in registered_shards(module).items():
        shard = module._parameters.get(name)
        if shard is None:
            shard = module._buffers.get(name)
        if shard is None or (prefix + name) not in state_dict:
            continue
        place = _place(shard, spec)
        if place is not None and is_whole_of(state_dict[prefix + name], shard, place):
            state_dict[prefix + name] = local_pieces(state_dict[prefix + name], shard, spec, place)


def _take_pieces_of_optimizer_state(optimizer, state_dict):
    """The same for an optimizer's state: whole momentum or moments given for a shard parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = dict(state_dict.get("state") or {})
    for index, values in state.items():
        if not isinstance(index, int) or index >= len(params) or not isinstance(values, dict):
            continue
        spec = _PARAMETERS.get(params[index])
        place = _place(params[index], spec) if spec is not None else None
        if place is not None:
            state[index] = {key: local_pieces(value, params[index], spec, place)
                            if is_whole_of(value, params[index], place) else value for key, value in values.items()}
    return {**state_dict, "state": state}


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    """Every optimizer that steps once shards exist gets the hook (it marks only the state of parameters
    that are shards when its state dict is taken)."""
    if not getattr(optimizer, _HOOKED, False):
        optimizer.register_state_dict_post_hook(_mark_optimizer_state)
        optimizer.register_load_state_dict_pre_hook(_take_pieces_of_optimizer_state)
        setattr(optimizer, _HOOKED, True)


def track(module: torch.nn.Module, name: str, spec) -> None:
    """Called when ``module`` records its parameter ``name`` as a shard."""
    global _optimizer_hook_installed
    param = module._parameters.get(name)
    if param is not None:
        _PARAMETERS[param] = spec
    if not module.__dict__.get(_HOOKED, False):
        module.register_state_dict_post_hook(_mark_module_entries)
        module.register_load_state_dict_pre_hook(_take_pieces_of_module_entries)
        module.__dict__[_HOOKED] = True
    if not _optimizer_hook_installed:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        register_optimizer_step_post_hook(_on_optimizer_step)
        _optimizer_hook_installed = True


def track_parameters(model: torch.nn.Module) -> None:
    """Re-reads which parameter objects are shards (after they were replaced, e.g. materialized)."""
    for module in model.modules():
        for name, spec in registered_shards(module).items():
            param = module._parameters.get(name)
            if param is not None:
                _PARAMETERS[param] = spec
