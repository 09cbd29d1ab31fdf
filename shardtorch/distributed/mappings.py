"""The communication mappings of tensor parallelism, differentiable, over the
ops torch.ops.shard.* (see csrc/ops/mappings.h).

=================  ======================  ==========================  ========================
function           forward                 backward                    op
=================  ======================  ==========================  ========================
copy               identity                all-reduce (sum)            shard::copy
reduce             all-reduce (sum)        identity                    shard::reduce
scatter            keep this rank's slice  all-gather                  shard::scatter
gather             all-gather              reduce-scatter (sum)        shard::all_gather
all_gather         all-gather              reduce-scatter (sum)        shard::all_gather
gather_replicated  all-gather              keep this rank's slice      shard::gather_replicated
reduce_scatter     reduce-scatter (sum)    all-gather                  shard::reduce_scatter
=================  ======================  ==========================  ========================

``gather`` and ``all_gather`` are the same function. The op ``shard::gather``
is the deprecated old name of ``shard::gather_replicated`` (until the next
release; it warns once): its name hid that its backward keeps the slice.

Every backward is the adjoint of its forward, which is what keeps TorchShard's
recipe exact: ``ts.distributed.gather(x, dim=0)`` of each rank's batch before a
sharded head, under DDP over all ranks, gives the backbone exactly the
gradient of unsharded training (TorchShard's gather kept only the local slice
of the gradient, leaving the backbone 1/W of the truth).

``gather_replicated`` is Megatron's gather: use it when every rank of the group
computes the same thing from the gathered tensor and the result counts once
per group (e.g. gathering a column-parallel output in a 2-D layout whose DDP
runs over the data-parallel group); its backward keeps the local slice of a
gradient that is the same on every rank.

Slices follow the split rule (the first ``n % size`` ranks hold one more), so
uneven sizes work everywhere. ``full_size`` tells the gathers the total length
along ``dim`` (and torch.compile the output shape); without it they exchange
shard sizes first (one tiny collective). On CPU, and on CUDA under
SHARDTORCH_DEBUG=1, they exchange them with ``full_size`` too, so that a rank
whose input does not fit makes every rank fail at once instead of leaving its
peers waiting in the gather; on CUDA otherwise the check is local (no host
synchronisation) and the peers fail at the communicator's timeout.
"""
from typing import Optional

import torch

from .. import _C  # noqa: F401  (registers the ops)
from ..utils.parallel_dim import register_parallel_dim
from .state import TENSOR_PARALLEL


def copy(input: torch.Tensor, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    return torch.ops.shard.copy(input, group)


def reduce(input: torch.Tensor, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    return torch.ops.shard.reduce(input, group)


def scatter(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    """This rank's slice along ``dim``, marked as sharded there (a following
    row-parallel layer then reads it as its shard, even when it holds every
    feature)."""
    output = torch.ops.shard.scatter(input, dim, group)
    return register_parallel_dim(output, dim - input.dim() if dim >= 0 else dim, input.shape[dim])


def gather(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL,
           full_size: Optional[int] = None) -> torch.Tensor:
    """All-gather along ``dim``; backward sums the group's gradients and keeps
    this rank's slice (the adjoint). The same as :func:`all_gather`."""
    return all_gather(input, dim, group, full_size)


def gather_replicated(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL,
                      full_size: Optional[int] = None) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's slice of the
    gradient (for downstream computation replicated over the group)."""
    return torch.ops.shard.gather_replicated(input, dim, group, full_size)


def all_gather(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL,
               full_size: Optional[int] = None) -> torch.Tensor:
    return torch.ops.shard.all_gather(input, dim, group, full_size)


def reduce_scatter(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    return torch.ops.shard.reduce_scatter(input, dim, group)
