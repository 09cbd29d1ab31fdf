"""TorchShard's convention for marking sharded tensors.

A column-parallel layer's output carries ``parallel_dim = -1`` (sharded on its
last dimension) so that a following row-parallel layer and the parallel loss
can check what they receive. Parameters carry the dimension of the full tensor
they were split along (used by the state-dict helpers).
"""
from typing import Optional

import torch


def register_parallel_dim(tensor: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """Marks ``tensor`` as sharded along ``dim`` (None: not sharded)."""
    tensor.parallel_dim = dim
    return tensor


def get_parallel_dim(tensor: torch.Tensor) -> Optional[int]:
    """The dimension ``tensor`` is sharded along, or None."""
    return getattr(tensor, "parallel_dim", None)


def is_sharded_on_last_dim(tensor: torch.Tensor) -> bool:
    dim = get_parallel_dim(tensor)
    return dim is not None and tensor.dim() > 0 and dim in (-1, tensor.dim() - 1)
