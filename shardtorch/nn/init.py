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
Shards for CUDA are drawn on the CPU generator and copied chunk by chunk (they
equal ``torch.nn.Linear(...)`` built on the CPU, then moved).
"""

import torch

from .. import _C

CHUNK_ELEMENTS = 1 << 20


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
