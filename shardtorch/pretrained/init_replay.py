"""Replaying a model's recorded init (init_record.InitRecord) into the tensors a rank keeps.

For each tensor the rank keeps (a shard, or a whole tensor), the writes its
original meta tensor received are replayed from the last one that replaced
all of it:
- a random fill of the whole tensor (``normal_``, ``uniform_``, and so the
  ``nn.init`` functions built on them: kaiming, xavier, trunc_normal's first
  step) is drawn whole, chunk by chunk, from the generator state recorded
  before it, and the rank keeps its pieces: the same numbers, bitwise, as the
  unsharded model's draw (``draw_pieces`` explains why the chunks agree);
- an element-wise write (``zero_``, ``fill_``, ``mul_``, ``erfinv_``, a
  ``copy_`` from a real tensor, a padding row's ``zero_``) is applied to the
  part of its region the rank keeps.
What cannot be reproduced slice by slice (a random fill of part of a sharded
tensor, a value computed from other meta tensors) raises ``InitReplayError``
naming the tensor and the operation; nothing else is drawn in its place.

``live=True`` (initialising the tensors a checkpoint lacks) draws from the
generators as they are now instead of the recorded states, so that tensors
drawn one after another get different numbers.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .chunked_draw import draw_pieces
from .init_record import CHUNKABLE, InitRecord, Write, aten, storage_key

# Writes that act element by element on the region they are given, so that a rank can apply them to its part
# of the region (an indexed write such as index_put_ or scatter_ names whole-tensor positions: refused on slices).
_ELEMENTWISE = {aten.fill_, aten.zero_, aten.copy_, aten.mul_, aten.add_, aten.sub_, aten.div_, aten.clamp_,
                aten.clamp_min_, aten.clamp_max_, aten.erfinv_, aten.masked_fill_, aten.abs_, aten.neg_, aten.sqrt_,
                aten.exp_, aten.log_, aten.pow_, aten.tanh_, aten.sign_, aten.addcmul_, aten.addcdiv_, aten.lerp_,
                aten.fmod_, aten.remainder_, aten.floor_, aten.ceil_, aten.round_, aten.trunc_}


class InitReplayError(RuntimeError):
    """A tensor whose initialisation cannot be reproduced on this rank's slice."""


def _box(view: torch.Tensor, shape: Sequence[int], base_offset: int):
    """([start per dim], [length per dim], [base dim of each view dim or None])
    of ``view`` inside a contiguous tensor of ``shape`` starting at
    ``base_offset`` of the same storage; None when ``view`` is not such a box."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    rest = view.storage_offset() - base_offset
    if rest < 0:
        return None
    start = []
    for d in range(len(shape)):
        index, rest = divmod(rest, strides[d])
        start.append(index)
    if rest != 0 or any(s >= max(n, 1) for s, n in zip(start, shape)):
        return None
    lengths = [1] * len(shape)
    mapping = []
    for k in range(view.dim()):
        if view.shape[k] == 1:
            mapping.append(None)
            continue
        candidates = [d for d in range(len(shape)) if shape[d] > 1 and strides[d] == view.stride(k)
                      and d not in mapping]
        if len(candidates) != 1:
            return None
        mapping.append(candidates[0])
        lengths[candidates[0]] = view.shape[k]
    if any(s + n > m for s, n, m in zip(start, lengths, shape)):
        return None
    return start, lengths, mapping


class _Target:
    """A tensor the rank keeps (``tensor``: its slices ``pieces`` along
    ``dim``, or the whole when ``dim`` is None) of the whole tensor
    ``original`` built on the meta device."""

    def __init__(self, name: str, tensor: torch.Tensor, original: torch.Tensor, dim: Optional[int],
                 pieces: Optional[List[Tuple[int, int]]]) -> None:
        self.name, self.tensor, self.original = name, tensor, original
        self.dim, self.pieces = dim, pieces


def _covers_all(view: torch.Tensor, base: torch.Tensor) -> bool:
    box = _box(view, tuple(base.shape), base.storage_offset())
    return box is not None and view.numel() == base.numel() and list(box[1]) == [max(n, 1) for n in base.shape]


@torch.no_grad()
def replay(record: InitRecord, targets: List[_Target], live: bool, who: str,
           generator: Optional[torch.Generator] = None) -> None:
    """Fills every target from the record (see the module docstring).
    ``live``: draw from ``generator`` (or the generator a write names, else
    torch's default) as it is now, not from the recorded states."""
    for target in targets:
        _fill(record, target, target.original, target.tensor, live, generator, who)


def _fill(record: InitRecord, target: _Target, base: torch.Tensor, local: torch.Tensor, live: bool,
          generator: Optional[torch.Generator], who: str) -> None:
    """Fills ``local`` (the target's slices, or whole) with what the meta tensor
    ``base`` holds at the end of the construction: its writes from the last
    one that replaced all of it, after, where none did, the values of the
    tensor it was copied from (``clone``, ``.to(dtype)``, ``module.to``),
    replayed in that tensor's dtype and then converted, as the construction did."""
    if not base.is_contiguous():
        raise InitReplayError(f"{who}: {target.name!r} is not a contiguous tensor at its creation, so its "
                              f"initialisation cannot be replayed on slices")
    key = storage_key(base)
    writes = record.writes.get(key, [])
    first = None
    for index, write in enumerate(writes):
        if write.overwrites and _covers_all(write.target, base) and not _reads_meta(write):
            first = index
    if first is None:
        first = 0
        source = record.copied.get(key)
        origin = record.origin.get(key, "empty")
        if source is not None:
            staged = torch.empty(local.shape, dtype=source.dtype)
            _fill(record, target, source, staged, live, generator, who)
            local.copy_(staged)
        elif origin != "empty":
            raise InitReplayError(
                f"{who}: {target.name!r} ({tuple(base.shape)}) is {origin} at construction, from values that "
                f"exist only whole; its slices cannot be drawn without them. Initialise it in place "
                f"(torch.nn.init / .normal_ / .uniform_ on the parameter) or load it from a checkpoint")
        elif not writes:
            raise InitReplayError(f"{who}: {target.name!r} ({tuple(base.shape)}) is never initialised by the "
                                  f"model's construction (created empty and never written)")
        else:
            raise InitReplayError(f"{who}: {target.name!r} is created empty and only part of it is ever "
                                  f"written ({writes[0].func}), so the rest would be undefined")
    for write in writes[first:]:
        _apply(write, target, base, local, _generator(write, live, generator) if write.random else None, who)


def _reads_meta(write: Write) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_meta for a in list(write.args[1:]) + list(write.kwargs.values()))


def _generator(write: Write, live: bool, generator: Optional[torch.Generator]) -> torch.Generator:
    if live:
        return write.generator or generator or torch.default_generator
    recorded = torch.Generator()
    recorded.set_state(write.rng_state)
    return recorded


def _apply(write: Write, target: _Target, base: torch.Tensor, local: torch.Tensor,
           generator: Optional[torch.Generator], who: str) -> None:
    """Applies one write into ``base`` to ``local`` (the target's part of it)."""
    if _reads_meta(write):
        raise InitReplayError(f"{who}: {target.name!r} is written by {write.func} from a value computed at "
                              f"construction, which exists only whole; initialise it in place or load it")
    view = write.target
    box = _box(view, tuple(base.shape), base.storage_offset())
    if box is None:
        raise InitReplayError(f"{who}: {target.name!r}: {write.func} writes a region that is not a block of the "
                              f"tensor, which cannot be mapped onto its slices")
    kwargs = dict(write.kwargs, generator=generator) if write.random else write.kwargs
    if target.dim is None:
        region = _region(local, box, view)
        if write.random and (region.dtype != view.dtype or region.device.type != "cpu"):
            # drawn on the CPU generator in the construction's dtype, as the construction drew it, then converted
            staged = torch.empty(region.shape, dtype=view.dtype)
            write.func(staged, *write.args[1:], **kwargs)
            region.copy_(staged)
        else:
            write.func(region, *write.args[1:], **kwargs)
        return
    if write.random:
        if write.func.overloadpacket not in CHUNKABLE or not _covers_all(view, base):
            raise InitReplayError(
                f"{who}: {target.name!r} is sharded and {write.func} draws "
                + ("only part of it" if write.func.overloadpacket in CHUNKABLE else "in a way not reproduced here")
                + "; only uniform_ / normal_ of the whole tensor can be drawn slice by slice")
        draw_pieces(write, tuple(base.shape), view.dtype, generator, target.dim, target.pieces, local)
        return
    if write.func.overloadpacket not in _ELEMENTWISE:
        raise InitReplayError(f"{who}: {target.name!r} is sharded and written by {write.func}, which is not an "
                              f"element-wise write a rank could apply to its slices")
    start, lengths, mapping = box
    at = 0
    d = target.dim
    for offset, count in target.pieces:
        lo, hi = max(start[d], offset), min(start[d] + lengths[d], offset + count)
        if lo < hi:
            local_start = list(start)
            local_start[d] = at + lo - offset
            local_lengths = list(lengths)
            local_lengths[d] = hi - lo
            region = _strided(local, local_start, local_lengths, mapping, view)
            args = [_narrow_argument(a, view, mapping, d, lo - start[d], hi - lo) for a in write.args[1:]]
            write.func(region, *args, **write.kwargs)
        at += count


def _region(tensor: torch.Tensor, box, view: torch.Tensor) -> torch.Tensor:
    start, lengths, mapping = box
    return _strided(tensor, start, lengths, mapping, view)


def _strided(tensor: torch.Tensor, start, lengths, mapping, view) -> torch.Tensor:
    """The view of the contiguous ``tensor`` covering the block ``start`` /
    ``lengths``, with its dimensions in ``view``'s order (``mapping``)."""
    strides = tensor.stride()
    offset = tensor.storage_offset() + sum(s * st for s, st in zip(start, strides))
    sizes = [1 if d is None else lengths[d] for d in mapping]
    view_strides = [1 if d is None else strides[d] for d in mapping]
    return tensor.as_strided(sizes, view_strides, offset)


def _narrow_argument(value, view: torch.Tensor, mapping, dim: int, start: int, length: int):
    """A real tensor argument of an element-wise write, cut like the region of the target it writes."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    expanded = value.expand(view.shape)
    if dim in mapping:
        expanded = expanded.narrow(mapping.index(dim), start, length)
    return expanded


def targets_of(model: torch.nn.Module, originals: Dict[str, torch.Tensor], names: Sequence[str]) -> List[_Target]:
    """The replay targets for ``names`` of the parallelized ``model``: each
    tensor once (tied names share it), sharded ones with their pieces."""
    from ..distributed import state
    from ..utils.shard_facts import named_parameter_shards
    specs = {name: spec for name, _, spec in named_parameter_shards(model)}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    seen = set()
    targets = []
    for name in names:
        tensor = tensors[name]
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        original = originals[name]
        spec = specs.get(name)
        if spec is None:
            if tuple(tensor.shape) != tuple(original.shape):
                raise InitReplayError(f"{name!r} changed shape from {tuple(original.shape)} to "
                                      f"{tuple(tensor.shape)} without being recorded as a shard")
            targets.append(_Target(name, tensor, original, None, None))
            continue
        size, rank = state.get_group_size(spec.group), state.get_group_rank(spec.group)
        pieces = spec.pieces(original.shape[spec.dim], size, rank)
        targets.append(_Target(name, tensor, original, spec.dim, pieces))
    return targets
