"""TorchShard's convention for marking sharded tensors.

A column-parallel layer's output carries ``parallel_dim = -1`` (sharded on its
last dimension) so that a following row-parallel layer and the parallel loss
can check what they receive, and ``parallel_full_size``, the length of the
whole tensor along that dimension, so that the parallel loss knows the number
of classes without asking its peers. Parameters carry the dimension of the full
tensor they were split along (used by the state-dict helpers).
"""
from typing import Optional

import torch


def register_parallel_dim(tensor: torch.Tensor, dim: Optional[int],
                          full_size: Optional[int] = None) -> torch.Tensor:
    """Marks ``tensor`` as sharded along ``dim`` (None: not sharded), of
    ``full_size`` elements along ``dim`` in all (None: not known)."""
    if full_size is not None and (dim is None or not isinstance(full_size, int) or isinstance(full_size, bool)
                                  or full_size < 0):
        raise ValueError(f"register_parallel_dim: full_size must be a non-negative int along a sharded dim, "
                         f"got full_size={full_size!r} with dim={dim!r}")
    tensor.parallel_dim = dim
    tensor.parallel_full_size = full_size
    return tensor


def get_parallel_dim(tensor: torch.Tensor) -> Optional[int]:
    """The dimension ``tensor`` is sharded along, or None."""
    return getattr(tensor, "parallel_dim", None)


def get_parallel_full_size(tensor: torch.Tensor) -> Optional[int]:
    """The whole length along ``get_parallel_dim(tensor)``, or None when the
    tensor is not marked or its mark did not say it."""
    if get_parallel_dim(tensor) is None:
        return None
    return getattr(tensor, "parallel_full_size", None)


def is_sharded_on_last_dim(tensor: torch.Tensor) -> bool:
    dim = get_parallel_dim(tensor)
    return dim is not None and tensor.dim() > 0 and dim in (-1, tensor.dim() - 1)
