"""Building a model without its large tensors, and recording how its own init fills them.

``build_recorded(factory)`` runs the model's own construction (its modules'
``reset_parameters``, Hugging Face's ``post_init`` / ``_init_weights``) with
every floating-point tensor created from a size (``empty``, ``zeros``, ``ones``,
``full``, ``rand``, ``randn`` and their ``new_`` / ``_like`` forms: every parameter
of torch's and transformers' layers) on the meta device: such tensors hold no
memory, and every write into them (``normal_``, ``uniform_``, ``zero_``,
``fill_``, ``copy_`` from a real tensor, ...) is recorded in order with the
state of the random generator it would draw from. Tensors computed from real
values (``arange`` and what follows: rotary frequencies, position ids) stay
real, exactly as the model builds them.

With ``consume_random=True`` each draw into a meta tensor also advances the
generator as drawing the whole tensor would (in bounded chunks, see
chunked_draw.draw_pieces), so any real tensor drawn after it gets the numbers
the unsharded model's gets, and the recorded generator states are the ones the
unsharded model's own draws start from. ``init_replay`` later replays the
record into each rank's slices.

The record is kept by a TorchDispatchMode (every aten op of the construction
passes it): in-place writes to meta tensors, random factories (``randn``) and
where each meta storage came from. A meta storage made by computation
(``torch.randn(n) * 0.02``, ``orthogonal_``'s QR) holds values no slice can be
drawn for: the replay refuses it by name unless a later whole write replaces
them.
"""
from typing import Callable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .chunked_draw import consume_like
from .init_record import InitRecord, Write, aten, storage_key
from .is_meta_while_building import meta_tensors_answer_not_meta

# Random factories, as the in-place fill of an empty tensor they equal.
RANDOM_FACTORIES = {aten.randn: (aten.normal_.default, (0.0, 1.0)), aten.rand: (aten.uniform_.default, (0.0, 1.0))}
_SIZED_FACTORIES = {aten.empty, aten.zeros, aten.ones, aten.full, aten.rand, aten.randn, aten.empty_strided}
_NEW_FACTORIES = {aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided}
_LIKE_FACTORIES = {aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like,
                   aten.randn_like}
_FILLS = {aten.zeros: 0.0, aten.ones: 1.0, aten.zeros_like: 0.0, aten.ones_like: 1.0, aten.new_zeros: 0.0,
          aten.new_ones: 1.0}


class MetaBuildError(RuntimeError):
    """A model whose construction cannot run on the meta device."""


def _on_meta(tensor: torch.Tensor) -> bool:
    # Not tensor.is_meta: while a model is built, that answers False (is_meta_while_building.py).
    return tensor.device.type == "meta"




def _is_factory(func) -> bool:
    """An op that creates a tensor from a size (or another tensor's size) alone."""
    packet = func.overloadpacket
    return packet in _SIZED_FACTORIES or packet in _NEW_FACTORIES or packet in _LIKE_FACTORIES


def _creates_floating(func, args, kwargs) -> bool:
    """Whether a factory makes a floating-point tensor. Others (boolean masks, integer ids: GPTBigCode's
    causal mask, BERT's token type ids) stay real: no parameter is one, and a buffer computed from them
    (``tril`` of ``ones``) exists only whole, which every rank holds anyway."""
    dtype = kwargs.get("dtype")
    if dtype is None:
        source = args[0] if func.overloadpacket in _NEW_FACTORIES or func.overloadpacket in _LIKE_FACTORIES else None
        dtype = source.dtype if isinstance(source, torch.Tensor) else torch.get_default_dtype()
    return dtype.is_floating_point or dtype.is_complex


def _generator_of(kwargs) -> Optional[torch.Generator]:
    generator = kwargs.get("generator")
    return generator if isinstance(generator, torch.Generator) else None


def _written_tensors(func, args, kwargs) -> List[torch.Tensor]:
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or position >= len(args) else args[position]
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


class _Recorder(TorchDispatchMode):
    def __init__(self, record: InitRecord, consume_random: bool) -> None:
        super().__init__()
        self.record, self.consume_random = record, consume_random

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        factory = _is_factory(func) and _creates_floating(func, args, kwargs)
        if factory:
            kwargs["device"] = torch.device("meta")
        for tensor in _written_tensors(func, args, kwargs):
            if _on_meta(tensor):
                self._write(func, args, kwargs)
                break
        known = {storage_key(t) for t in _tensors(args, kwargs) if _on_meta(t)}
        out = func(*args, **kwargs)
        for tensor in _tensors((out,), {}):
            if _on_meta(tensor) and storage_key(tensor) not in known and storage_key(tensor) not in self.record.origin:
                self._created(func, args, kwargs, tensor, factory)
        return out

    def _write(self, func, args, kwargs) -> None:
        generator = _generator_of(kwargs)
        write = Write(func, args, kwargs, generator=generator)
        if write.random:
            write.rng_state = (generator or torch.default_generator).get_state()
            if self.consume_random:
                consume_like(write)
        key = storage_key(write.target)
        self.record.writes.setdefault(key, []).append(write)
        self.record.keep.append(write.target)

    def _created(self, func, args, kwargs, tensor, factory: bool) -> None:
        key = storage_key(tensor)
        self.record.keep.append(tensor)
        packet = func.overloadpacket
        if not factory:
            source = _copied_from(func, args, tensor)
            if source is not None:
                self.record.copied[key] = source
            self.record.origin[key] = f"computed by {packet.__name__}"
            return
        self.record.origin[key] = "empty"
        if packet in RANDOM_FACTORIES:
            fill, fill_args = RANDOM_FACTORIES[packet]
            self._write(fill, (tensor,) + fill_args, {"generator": kwargs.get("generator")})
        elif packet in _FILLS or packet in (aten.full, aten.new_full, aten.full_like):
            value = _FILLS.get(packet)
            if value is None:
                value = args[2] if packet is aten.new_full else args[1]
            self.record.writes.setdefault(key, []).append(Write(aten.fill_.Scalar, (tensor, value), {}))
        elif packet not in (aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
                            aten.empty_like):
            self.record.origin[key] = f"computed by {packet.__name__}"


# Ops whose output holds its input's values (maybe in another dtype): clones, casts, a padding of nothing
# (transformers' tie_weights pads a tied head's bias to the vocabulary size).
_VALUE_COPIES = {aten.clone, aten._to_copy, aten.lift_fresh_copy, aten.alias_copy, aten.detach_copy}


def _copied_from(func, args, out: torch.Tensor) -> Optional[torch.Tensor]:
    """The meta tensor whose values ``out`` (made by ``func``) holds, or None."""
    packet = func.overloadpacket
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if source is None or not _on_meta(source) or tuple(source.shape) != tuple(out.shape):
        return None
    if packet in _VALUE_COPIES or (packet is aten.constant_pad_nd and not any(args[1])):
        return source
    return None


def _tensors(args, kwargs):
    found = []

    def visit(value):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
    visit(args)
    visit(kwargs)
    return found


def build_recorded(factory: Callable[[], torch.nn.Module], consume_random: bool) -> Tuple[torch.nn.Module,
                                                                                         InitRecord]:
    """(the model ``factory()`` builds, its sized tensors on the meta device,
    and the record of what its construction wrote into them). Raises
    MetaBuildError where the construction reads values of its meta tensors."""
    record = InitRecord()
    try:
        with _Recorder(record, consume_random), meta_tensors_answer_not_meta():
            model = factory()
    except (RuntimeError, NotImplementedError) as error:
        if "meta" not in str(error):
            raise
        raise MetaBuildError(
            f"building the model on the meta device failed where its construction reads the values of a tensor "
            f"it initialises ({error}): such an initialisation (torch 2.14's trunc_normal_ resamples until every "
            f"value is in range, say) exists only as the whole tensor's values, so its slices cannot be drawn "
            f"alone") from error
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the model factory must return a torch.nn.Module, got {type(model).__name__}")
    return model, record


def build_recorded_partly(factory: Callable[[], torch.nn.Module]) -> Tuple[torch.nn.Module, InitRecord]:
    """As build_recorded, but the initialisers that skip meta tensors skip them
    (the record misses what they would write): for a model whose weights are
    then loaded."""
    record = InitRecord()
    with _Recorder(record, consume_random=False):
        return factory(), record
