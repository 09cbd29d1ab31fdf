"""Initialising shards exactly as torch.nn.Linear would, without the full weight.

torch.nn.Linear draws its weight with ``uniform_`` on the CPU generator, one
number per element in row-major order, then its bias. Drawing the same matrix
chunk by chunk (whole rows at a time) consumes the generator identically, so
each rank can keep just its slice and throw the rest away: the shard equals the
slice of ``torch.nn.Linear(in, out)`` made under the same ``torch.manual_seed``,
bitwise, and the generator ends in the same state.

Peak extra memory while constructing: one chunk of
``max(in_features, CHUNK_ELEMENTS)`` elements of the parameter dtype
(``CHUNK_ELEMENTS = 2**20``, 4 MiB in float32), whatever out_features is.
Shards for other devices are drawn on the CPU generator into a CPU tensor of the
shard's shape, then copied (they equal ``torch.nn.Linear(...)`` built on the
CPU, then moved): see ``draw_on_cpu_``.
"""
from typing import Callable, Optional

import torch

from .. import _C

CHUNK_ELEMENTS = 1 << 20


@torch.no_grad()
def draw_on_cpu_(fill: Callable[..., None], *tensors: Optional[torch.Tensor]) -> None:
    """Runs ``fill(*tensors)``, which draws on the CPU generator as torch.nn's
    layers do: on the tensors themselves when they live on the CPU, else on
    CPU tensors of their shapes and dtypes whose values are then copied to
    them. Tensors on the meta device hold no values: nothing happens. None
    entries (an absent bias) stay None."""
    present = [t for t in tensors if t is not None]
    if any(t.device.type == "meta" for t in present):
        return
    if all(t.device.type == "cpu" for t in present):
        fill(*tensors)
        return
    staged = [None if t is None else torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    fill(*staged)
    for tensor, values in zip(tensors, staged):
        if tensor is not None:
            tensor.copy_(values)


def init_linear_shard_(weight: torch.Tensor, bias, in_features: int, out_features: int,
                       out_range=None, in_range=None) -> None:
    """Fills ``weight`` (rows ``out_range``, columns ``in_range`` of the full
    [out_features, in_features] matrix) and ``bias`` (``out_range`` of the full
    bias, or all of it when ``bias.numel() == out_features``) as torch.nn.Linear.

    The C++ core does the drawing (csrc/nn/init.cpp, the same code as the C++
    ParallelLinear), so Python and C++ shards agree by construction; it reads
    ``CHUNK_ELEMENTS`` at each call, so tests may change it."""
    out_range = tuple(out_range or (0, out_features))
    in_range = tuple(in_range or (0, in_features))
    _C.init_linear_shard_(weight, bias, in_features, out_features, out_range, in_range,
                          CHUNK_ELEMENTS)
