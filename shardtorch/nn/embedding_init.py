"""Initialising an embedding shard exactly as torch.nn.Embedding would.

torch.nn.Embedding draws its weight with ``normal_`` on the CPU generator. For
a contiguous tensor of at least 16 elements, torch's CPU kernel first fills
every element with a uniform number in order, turns each aligned block of 16
into normals (Box-Muller), and, when the size is not a multiple of 16, draws 16
fresh uniforms for the last 16 elements and transforms those. Drawing the
table in chunks therefore gives the same numbers, bitwise, if and only if every
chunk but the last holds a multiple of 16 elements (blocks stay aligned) and
the last holds at least 16 (its tail redraw is the table's). Tables of fewer
than 16 elements take torch's element-by-element path: they are drawn whole.

Each rank draws the whole table chunk by chunk (the generator cannot skip
ahead) and keeps its slice: peak extra memory is one chunk of about
``CHUNK_ELEMENTS`` elements, whatever the vocabulary size.
"""
import math

import torch

CHUNK_ELEMENTS = 1 << 20
_BLOCK = 16  # torch's CPU normal_ transforms uniforms 16 at a time


def _chunk_bounds(rows: int, cols: int):
    """Row ranges [first, last) whose element counts keep torch's 16-blocks aligned."""
    total = rows * cols
    if total < _BLOCK:
        return [(0, rows)] if rows else []
    row_step = _BLOCK // math.gcd(cols, _BLOCK)  # rows per aligned unit
    chunk_rows = max(row_step, (CHUNK_ELEMENTS // max(cols, 1)) // row_step * row_step)
    bounds = [[first, min(rows, first + chunk_rows)] for first in range(0, rows, chunk_rows)]
    if len(bounds) > 1 and (bounds[-1][1] - bounds[-1][0]) * cols < _BLOCK:
        tail = bounds.pop()
        bounds[-1][1] = tail[1]  # a short tail joins the chunk before it
    return [tuple(b) for b in bounds]


@torch.no_grad()
def init_embedding_shard_(weight: torch.Tensor, num_embeddings: int, embedding_dim: int,
                          row_range, col_range, padding_idx=None) -> None:
    """Fills ``weight`` (rows ``row_range``, columns ``col_range`` of the full
    [num_embeddings, embedding_dim] table) as torch.nn.Embedding, padding row
    zeroed."""
    (r0, r1), (c0, c1) = row_range, col_range
    for first, last in _chunk_bounds(num_embeddings, embedding_dim):
        chunk = torch.empty(last - first, embedding_dim, dtype=weight.dtype).normal_()
        lo, hi = max(first, r0), min(last, r1)
        if lo < hi:
            weight[lo - r0:hi - r0].copy_(chunk[lo - first:hi - first, c0:c1])
    if padding_idx is not None and r0 <= padding_idx < r1:
        weight[padding_idx - r0].fill_(0)
