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
import math

import torch

CHUNK_ELEMENTS = 1 << 20


def linear_bounds(in_features: int):
    """The uniform bounds torch.nn.Linear uses for its weight and its bias."""
    gain = torch.nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    std = gain / math.sqrt(in_features) if in_features > 0 else 0.0
    weight_bound = math.sqrt(3.0) * std
    bias_bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return weight_bound, bias_bound


@torch.no_grad()
def _draw_rows_into(out: torch.Tensor, rows: int, cols: int, bound: float,
                    row_start: int, row_stop: int, col_start: int, col_stop: int) -> None:
    """Draws a [rows, cols] uniform(-bound, bound) matrix chunk by chunk and
    copies its [row_start:row_stop, col_start:col_stop] block into ``out``."""
    if rows == 0 or cols == 0:
        return
    chunk_rows = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for first in range(0, rows, chunk_rows):
        last = min(rows, first + chunk_rows)
        chunk = torch.empty(last - first, cols, dtype=out.dtype).uniform_(-bound, bound)
        lo, hi = max(first, row_start), min(last, row_stop)
        if lo < hi:
            out[lo - row_start:hi - row_start].copy_(chunk[lo - first:hi - first, col_start:col_stop])


@torch.no_grad()
def init_linear_shard_(weight: torch.Tensor, bias, in_features: int, out_features: int,
                       out_range=None, in_range=None) -> None:
    """Fills ``weight`` (rows ``out_range``, columns ``in_range`` of the full
    [out_features, in_features] matrix) and ``bias`` (``out_range`` of the full
    bias, or all of it when ``bias.numel() == out_features``) as torch.nn.Linear."""
    out_range = out_range or (0, out_features)
    in_range = in_range or (0, in_features)
    weight_bound, bias_bound = linear_bounds(in_features)
    _draw_rows_into(weight, out_features, in_features, weight_bound,
                    out_range[0], out_range[1], in_range[0], in_range[1])
    if bias is not None:
        bias_range = (0, out_features) if bias.numel() == out_features else out_range
        _draw_rows_into(bias.view(-1, 1), out_features, 1, bias_bound,
                        bias_range[0], bias_range[1], 0, 1)
