"""torch's state-dict API (``torch.distributed.checkpoint.state_dict``) and shardtorch's shards.

torch's ``get_state_dict(..., options=StateDictOptions(full_state_dict=True))``
gathers DTensors and ShardedTensors but keeps a plain tensor as it is: a
shard would be handed out as if it were the whole tensor. The state-dict hooks
of dcp_marks.py ask here whether torch's call wants the full state dict (its
options are a local of torch's caller), and then put each shard's whole tensor
in its place (gathered over its group: every rank takes the state dict, as
torch requires); on load, whole tensors given for shards (``set_state_dict``
with ``full_state_dict=True``, or a plain ``load_state_dict`` of the unsharded
model's state dict) give this rank's pieces. Under fully_shard a shard is a
DTensor over the data-parallel mesh only, which describes it as the whole: the
full state dict raises, the sharded one warns.
"""
import sys

import torch

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


def full_state_dict_requested() -> bool:
    return bool(getattr(_torch_get_state_dict_options(), "full_state_dict", False))


_warned_under_fully_shard = False


def refuse_under_fully_shard(key: str, tensor, spec) -> None:
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


def _entry(shard: torch.Tensor, spec, place: tuple):
    """The checkpoint layout of one shard, so that the checkpoint code's transfers serve it."""
    from ..checkpoint.layout import EntryLayout
    from ..distributed import state
    full_shape, dim, _ = place
    return EntryLayout("", tuple(shard.shape), tuple(full_shape), shard.dtype, shard.device, dim, spec.group,
                       state.get_group_rank(spec.group), state.get_group_size(spec.group), blocks=spec.blocks,
                       unit=spec.unit, parts=spec.parts)


def gather_whole(tensor: torch.Tensor, spec, place: tuple) -> torch.Tensor:
    """The whole tensor of which ``tensor`` is this rank's shard, on every rank of its group (a
    collective: every rank calls it for the same entries)."""
    from ..checkpoint.transfers import gather_everywhere
    return gather_everywhere(tensor, _entry(tensor, spec, place))


def local_pieces(whole: torch.Tensor, shard: torch.Tensor, spec, place: tuple) -> torch.Tensor:
    """This rank's pieces of ``whole``, in the order ``shard`` holds them: a tensor of its own, never a
    view of ``whole`` (an optimizer keeps what it loads and updates it in place)."""
    entry = _entry(shard, spec, place)
    return entry.take(whole, entry.group_rank).clone()


def is_whole_of(value, shard: torch.Tensor, place: tuple) -> bool:
    """Whether a value given for ``shard`` is its whole tensor (not a shard of it)."""
    return (isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(place[0])
            and tuple(value.shape) != tuple(shard.shape))
