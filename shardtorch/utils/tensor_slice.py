"""``ts.slice``: TorchShard's helper to cut a tensor into one piece per rank."""
from typing import Optional, Tuple

import torch

from .. import _C


def slice(tensor: torch.Tensor, num_partitions: int, dim: Optional[int] = None,
          contiguous: bool = False) -> Tuple[torch.Tensor, ...]:
    """``tensor`` cut into ``num_partitions`` pieces along ``dim`` (None: the
    last, as TorchShard documents), views unless ``contiguous``. Pieces follow
    shardtorch's split rule (the first ``n % num_partitions`` are one longer),
    so piece ``r`` is what ``ts.distributed.scatter`` gives group rank ``r``;
    TorchShard refused a length that does not divide."""
    if not isinstance(num_partitions, int) or isinstance(num_partitions, bool) or num_partitions < 1:
        raise ValueError(f"slice: num_partitions must be a positive int, got {num_partitions!r}")
    dim = -1 if dim is None else dim
    if tensor.dim() == 0 or not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"slice: dim must be in [{-tensor.dim()}, {tensor.dim()}) for a tensor of shape "
                         f"{tuple(tensor.shape)}, got {dim}")
    pieces = torch.split(tensor, list(_C.shard_sizes(tensor.shape[dim], num_partitions)), dim=dim)
    return tuple(p.contiguous() for p in pieces) if contiguous else tuple(pieces)
