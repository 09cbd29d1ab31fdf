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
``shardtorch.nn.init.CHUNK_ELEMENTS`` elements, whatever the vocabulary size.
"""
import torch

from .. import _C
from . import init


def init_embedding_shard_(weight: torch.Tensor, num_embeddings: int, embedding_dim: int,
                          row_range, col_range, padding_idx=None) -> None:
    """Fills ``weight`` (rows ``row_range``, columns ``col_range`` of the full
    [num_embeddings, embedding_dim] table) as torch.nn.Embedding, padding row
    zeroed.

    The C++ core does the drawing (csrc/nn/embedding_init.cpp, the same code as
    the C++ ParallelEmbedding); it reads ``init.CHUNK_ELEMENTS`` at each call,
    so tests may change it."""
    _C.init_embedding_shard_(weight, num_embeddings, embedding_dim, tuple(row_range), tuple(col_range),
                             padding_idx, init.CHUNK_ELEMENTS)
