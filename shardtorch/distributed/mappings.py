"""The communication mappings of tensor parallelism, differentiable, over the
ops torch.ops.shard.* (see csrc/ops/mappings.h). Each backward is the adjoint
of its forward:

=================  ==============================  ============================
function           forward                         backward
=================  ==============================  ============================
copy               identity                        all-reduce (sum)
reduce             all-reduce (sum)                identity
scatter            keep this rank's slice          all-gather
gather             all-gather                      keep this rank's slice
all_gather         all-gather                      reduce-scatter (sum)
reduce_scatter     reduce-scatter (sum)            all-gather
=================  ==============================  ============================

Slices follow the split rule (the first ``n % size`` ranks hold one more), so
uneven sizes work everywhere. ``full_size`` tells the gathers the total length
along ``dim``; without it they exchange shard sizes first (one tiny collective).
"""
from typing import Optional

import torch

from .. import _core  # noqa: F401  (registers the ops)
from .state import TENSOR_PARALLEL


def copy(input: torch.Tensor, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    return torch.ops.shard.copy(input, group)


def reduce(input: torch.Tensor, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    return torch.ops.shard.reduce(input, group)


def scatter(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    return torch.ops.shard.scatter(input, dim, group)


def gather(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL,
           full_size: Optional[int] = None) -> torch.Tensor:
    return torch.ops.shard.gather(input, dim, group, full_size)


def all_gather(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL,
               full_size: Optional[int] = None) -> torch.Tensor:
    return torch.ops.shard.all_gather(input, dim, group, full_size)


def reduce_scatter(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    return torch.ops.shard.reduce_scatter(input, dim, group)
