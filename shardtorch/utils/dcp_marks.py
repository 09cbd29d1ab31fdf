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

Under ``get_state_dict(..., options=StateDictOptions(full_state_dict=True))``
torch gathers DTensors and ShardedTensors but keeps a plain tensor as it is:
there the hooks put each shard's whole tensor in its place instead (gathered
over its group, every rank taking the state dict as torch requires), so that
the "full" state dict is the unsharded model's and not a set of shards.
"""
import sys
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

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


_FULL_STATE_DICT_CALLERS = ("_get_model_state_dict", "_get_optim_state_dict")


def _torch_get_state_dict_options():
    """The options of torch's get_state_dict (or its model / optimizer halves) when this state_dict()
    call comes from it (the caller's frame holds them as ``info``), else None."""
    frame = sys._getframe(2)
    for _ in range(64):  # the hooks run at the bottom of state_dict()'s recursion into submodules
        if frame is None:
            return None
        if (frame.f_code.co_name in _FULL_STATE_DICT_CALLERS
                and frame.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict"):
            return frame.f_locals.get("info")
        frame = frame.f_back
    return None


def _full_state_dict_requested() -> bool:
    return bool(getattr(_torch_get_state_dict_options(), "full_state_dict", False))


_warned_under_fully_shard = False


def _refuse_under_fully_shard(key: str, tensor, spec) -> None:
    """torch's get_state_dict of a tensor-parallel shard that fully_shard made a DTensor: that DTensor
    describes the shard as the whole tensor over the data-parallel mesh, so torch's full state dict (or
    dcp.save of its state dict) would hold one tensor-parallel rank's shard as the whole. The full state
    dict raises, on every rank before any collective; the sharded one (which ts.collect_state_dict and
    ts.collect_optimizer_state_dict read rightly) warns once that dcp.save of it would lose shards."""
    global _warned_under_fully_shard
    from ..distributed import state
    from .fsdp_detection import is_dtensor
    if not is_dtensor(tensor) or state.get_group_size(spec.group) == 1:
        return
    options = _torch_get_state_dict_options()
    if options is None:
        return
    what = (f"{key!r} is a shard over tensor-parallel group {spec.group!r} ({state.get_group_size(spec.group)} "
            "ranks) that fully_shard made a DTensor over the data-parallel mesh only")
    if getattr(options, "full_state_dict", False):
        raise NotImplementedError(
            f"shardtorch: torch's get_state_dict(full_state_dict=True) cannot gather {what}: it would return one "
            "tensor-parallel rank's shard as the whole tensor; use ts.collect_state_dict / "
            "ts.collect_optimizer_state_dict (fqn_keys=True gives torch's keys)")
    if not _warned_under_fully_shard:
        _warned_under_fully_shard = True
        import warnings
        warnings.warn(
            f"shardtorch: in torch's get_state_dict, {what}: dcp.save of this state dict would keep one "
            "tensor-parallel rank's shard as the whole tensor. Save with ts.checkpoint.save_dcp / load_dcp (or "
            "ts.save_sharded); ts.collect_state_dict / collect_optimizer_state_dict(state_dict=...) read it rightly",
            stacklevel=3)


def _whole(tensor: torch.Tensor, spec, place: tuple) -> torch.Tensor:
    """The whole tensor of which ``tensor`` is this rank's shard, on every rank of its group: each
    rank's pieces broadcast by their holder (a collective: every rank calls it for the same entries)."""
    import torch.distributed as dist
    from ..distributed import state
    full_shape, dim, _ = place
    size, members = state.get_group_size(spec.group), state.get_group_ranks(spec.group)
    me, process_group = state.get_group_rank(spec.group), state.get_group(spec.group)
    whole = torch.empty(full_shape, dtype=tensor.dtype, device=tensor.device)
    for group_rank, peer in enumerate(members):
        pieces = spec.pieces(spec.full_size, size, group_rank)
        shape = list(full_shape)
        shape[dim] = sum(length for _, length in pieces)
        if shape[dim] == 0:
            continue
        held = tensor.detach().contiguous() if group_rank == me else torch.empty(
            shape, dtype=tensor.dtype, device=tensor.device)
        dist.broadcast(held, peer, group=process_group)
        at = 0
        for offset, length in pieces:
            whole.narrow(dim, offset, length).copy_(held.narrow(dim, at, length))
            at += length
    return whole


def _mark_module_entries(module, state_dict, prefix, local_metadata) -> None:
    from .shard_facts import registered_shards
    full = None
    for name, spec in registered_shards(module).items():
        param = module._parameters.get(name)
        if param is not None:
            _PARAMETERS[param] = spec
        entry = state_dict.get(prefix + name)
        if isinstance(entry, torch.Tensor):
            _refuse_under_fully_shard(prefix + name, entry, spec)
            place = _place(entry, spec)
            if place is None:
                continue
            full = _full_state_dict_requested() if full is None else full
            if full:
                state_dict[prefix + name] = _whole(entry, spec, place)
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
        _refuse_under_fully_shard(f"the optimizer state of parameter {index}", param, spec)
        place = _place(param, spec)
        if place is None:
            continue
        full = _full_state_dict_requested() if full is None else full
        if full:
            # A new dict: torch's state_dict() hands out the optimizer's own state dicts.
            state_dict["state"][index] = {
                key: _whole(value, spec, place) if _is_state_of(value, param) else value
                for key, value in values.items()}
            continue
        for value in values.values():
            if _is_state_of(value, param):
                mark(value, *place)


def _is_state_of(value, param) -> bool:
    """Whether an optimizer state value is shaped as its parameter (momentum, Adam's moments)."""
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)


def _local(whole: torch.Tensor, place: tuple) -> torch.Tensor:
    """This rank's pieces of ``whole``, in the order its shard holds them."""
    _, dim, pieces = place
    return torch.cat([whole.narrow(dim, offset, length) for offset, length in pieces], dim)


def _is_whole_of(value, shard: torch.Tensor, place: tuple) -> bool:
    """Whether a value given for ``shard`` is its whole tensor (not a shard of it)."""
    return (isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(place[0])
            and tuple(value.shape) != tuple(shard.shape))


def _take_pieces_of_module_entries(module, state_dict, prefix, *args) -> None:
    """load_state_dict of a whole tensor where this rank holds a shard (torch's set_state_dict with
    full_state_dict=True gives whole tensors): this rank's pieces are taken from it."""
    from .shard_facts import registered_shards
    for name, spec in registered_shards(module).items():
        shard = module._parameters.get(name)
        if shard is None:
            shard = module._buffers.get(name)
        if shard is None or (prefix + name) not in state_dict:
            continue
        place = _place(shard, spec)
        if place is not None and _is_whole_of(state_dict[prefix + name], shard, place):
            state_dict[prefix + name] = _local(state_dict[prefix + name], place)


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
            state[index] = {key: _local(value, place) if _is_whole_of(value, params[index], place) else value
                            for key, value in values.items()}
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
    from .shard_facts import registered_shards
    for module in model.modules():
        for name, spec in registered_shards(module).items():
            param = module._parameters.get(name)
            if param is not None:
                _PARAMETERS[param] = spec
