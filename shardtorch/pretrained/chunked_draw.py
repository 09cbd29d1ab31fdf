"""Drawing a whole random tensor chunk by chunk, keeping a rank's pieces: the same numbers, bitwise, as
one draw of the whole tensor, in bounded memory (``draw_pieces``); and advancing a generator as a
draw into a meta tensor would have (``consume_like``)."""
import math
from typing import List, Optional, Sequence, Tuple

import torch

from ..nn import init as ts_init
from .init_record import CHUNKABLE, Write, aten


def draw_pieces(write: Write, shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator,
                dim: int = 0, pieces: Optional[List[Tuple[int, int]]] = None,
                out: Optional[torch.Tensor] = None) -> None:
    """Draws the whole contiguous tensor of ``shape`` as ``write`` (``uniform_``
    or ``normal_``) would, chunk by chunk on the CPU from ``generator``, and
    copies ``pieces`` [(offset, length)] along ``dim`` into ``out`` (None:
    draws only, to advance the generator).

    Why chunks agree with the whole draw: torch's CPU ``uniform_`` takes one
    number per element in order; its ``normal_`` fills the tensor with uniforms
    in order, turns each aligned block of 16 into normals, and when the size is
    not a multiple of 16 draws 16 more for the last 16 elements. So chunks of
    multiples of 16 elements, the last one of at least 16, draw what the whole
    tensor draws, element for element (tests/distributed/cases_pretrained.py's
    case_fresh_models_draw_the_unsharded_models_slices holds every weight of
    five float32 models bitwise to the unsharded draw). Tensors under 16
    elements are drawn whole."""
    total = math.prod(shape)
    if total == 0:
        return
    dims = list(shape) or [1]
    outer, length, inner = math.prod(dims[:dim]), dims[dim], math.prod(dims[dim + 1:])
    row = length * inner
    grain = 16 if write.func.overloadpacket is aten.normal_ else 1  # normal_'s aligned blocks
    aligned = row * grain // math.gcd(row, grain)
    if aligned <= ts_init.CHUNK_ELEMENTS:  # whole rows per chunk: pieces are slices of a [rows, length, inner] view
        step = ts_init.CHUNK_ELEMENTS // aligned * aligned
    else:
        step = max(16, ts_init.CHUNK_ELEMENTS // 16 * 16)
    local = None if out is None else out.view(outer, sum(n for _, n in pieces), inner)
    args, kwargs = write.args[1:], dict(write.kwargs, generator=generator)
    func = write.func
    first = 0
    while first < total:
        last = min(total, first + step)
        if total - last < 16:
            last = total
        chunk = torch.empty(last - first, dtype=dtype)
        func(chunk, *args, **kwargs)
        if local is not None:
            _keep(chunk, first, last, row, inner, pieces, local)
        first = last


def _keep(chunk, first, last, row, inner, pieces, local) -> None:
    """Copies what [first, last) of the whole tensor (flat) holds of the pieces into ``local``."""
    if first % row == 0 and last % row == 0:
        rows = chunk.view(-1, row // inner, inner)
        start = first // row
        at = 0
        for offset, count in pieces:
            local[start:start + rows.shape[0], at:at + count].copy_(rows[:, offset:offset + count])
            at += count
        return
    flat_local = local.view(local.shape[0], -1)
    for index in range(first // row, (last - 1) // row + 1):
        at = 0
        for offset, count in pieces:
            lo = max(first, index * row + offset * inner)
            hi = min(last, index * row + (offset + count) * inner)
            if lo < hi:
                where = at * inner + lo - (index * row + offset * inner)
                flat_local[index, where:where + hi - lo].copy_(chunk[lo - first:hi - first])
            at += count


def consume_like(write: Write) -> None:
    """Advances the write's generator as the write on a real tensor would (the write itself hit a meta tensor)."""
    generator = write.generator or torch.default_generator
    target = write.target
    if write.func.overloadpacket in CHUNKABLE and target.is_contiguous():
        draw_pieces(write, tuple(target.shape), target.dtype, generator)
        return
    temporary = torch.empty(target.shape, dtype=target.dtype)  # other draws: the real thing, thrown away
    write.func(temporary, *write.args[1:], **dict(write.kwargs, generator=generator))
