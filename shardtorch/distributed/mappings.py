"""The communication mappings of tensor parallelism, differentiable, over the
ops torch.ops.shard.* (see csrc/ops/mappings.h).

=================  ======================  ==========================  ========================
function           forward                 backward                    op
=================  ======================  ==========================  ========================
copy               identity                all-reduce (sum)            shard::copy
reduce             all-reduce (sum)        identity                    shard::reduce
scatter            keep this rank's slice  all-gather                  shard::scatter
all_gather         all-gather              reduce-scatter (sum)        shard::all_gather
gather_replicated  all-gather              keep this rank's slice      shard::gather_replicated
gather             all-gather              by the gather rule below    either of the two above
reduce_scatter     reduce-scatter (sum)    all-gather                  shard::reduce_scatter
=================  ======================  ==========================  ========================

A gather has two real uses, whose true gradients differ (both exact here):

- the batch gather: ``ts.distributed.gather(x, dim=0)`` of each rank's own
  samples before a sharded head, under DDP over all ranks (TorchShard's
  recipe). DDP averages over every rank, so the backward must sum the group's
  gradients (``all_gather``, the adjoint), or the backbone gets 1/W of the
  truth (TorchShard's gather kept the local slice);
- the gather of one output's shards, followed by computation that every rank
  of the group repeats (a loss computed on every rank, TorchShard's,
  Megatron's and FairScale's convention): the backward keeps this rank's slice
  (``gather_replicated``), or the gradients come out W times too large.

The gather rule: ``gather`` along the last dimension of a tensor marked as
sharded there (a column-parallel output, ``parallel_dim`` 1 or -1) or of any
tensor of two or more dimensions is the second use (``gather_replicated``);
any other gather (along the batch dimension, or of a vector) is the first
(``all_gather``). Call ``all_gather`` or ``gather_replicated`` to choose
explicitly. Every output is whole: unmarked.

Slices follow the split rule (the first ``n % size`` ranks hold one more), so
uneven sizes work everywhere. ``full_size`` tells the gathers the total length
along ``dim`` (and torch.compile the output shape); without it they exchange
shard sizes first (one tiny collective). On CPU, and on CUDA under
SHARDTORCH_DEBUG=1, they exchange them with ``full_size`` too, so that a rank
whose input does not fit makes every rank fail at once instead of leaving its
peers waiting in the gather; on CUDA otherwise the check is local (no host
synchronisation) and the peers fail at the communicator's timeout.
"""
from typing import Callable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from .. import _C  # noqa: F401  (registers the ops)
from ..utils.parallel_dim import get_parallel_full_size, is_sharded_on_last_dim, register_parallel_dim
from .state import TENSOR_PARALLEL

# A plain torch DDP around a model with shards is checked (and its shards' averaging set up) at its
# first forward by shardtorch.nn.parallel.plain_ddp's check_active_ddp. That module sits a layer
# above this one (it needs the gradient averager of nn/parallel), so it hands its check down here
# when it is imported (``import shardtorch`` imports it) instead of this layer importing upward.
_data_parallel_check: Optional[Callable[[], None]] = None


def set_data_parallel_check(check: Callable[[], None]) -> None:
    """Installs what the mappings call, under a plain torch DDP, before their op."""
    global _data_parallel_check
    _data_parallel_check = check


def _check_data_parallel_wrapper() -> None:
    if _TorchDDP._active_ddp_module is not None and _data_parallel_check is not None:
        _data_parallel_check()


def copy(input: torch.Tensor, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    _check_data_parallel_wrapper()
    return torch.ops.shard.copy(input, group)


def reduce(input: torch.Tensor, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    _check_data_parallel_wrapper()
    return torch.ops.shard.reduce(input, group)


def scatter(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    """This rank's slice along ``dim``. A slice along the last dim is marked
    as a column-parallel output (``parallel_dim = -1``, with its full size), so
    that a following row-parallel layer reads it as its shard even when it
    holds every feature, and the parallel loss as sharded logits; a slice
    along another dim is not marked (TorchShard's mark cannot say which)."""
    _check_data_parallel_wrapper()
    output = torch.ops.shard.scatter(input, dim, group)
    if input.dim() > 0 and dim in (-1, input.dim() - 1):
        register_parallel_dim(output, -1, input.shape[dim])
    return output


def gather(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL,
           full_size: Optional[int] = None) -> torch.Tensor:
    """All-gather along ``dim``; the backward follows the gather rule (module
    docstring): along the last dim of a marked column-parallel output or of a
    tensor of 2 or more dims, that of :func:`gather_replicated` (keep this
    rank's slice); otherwise that of :func:`all_gather` (sum, the adjoint)."""
    if _gathers_replicated_shards(input, dim):
        if full_size is None:
            full_size = get_parallel_full_size(input)
        return gather_replicated(input, dim, group, full_size)
    return all_gather(input, dim, group, full_size)


def _gathers_replicated_shards(input: torch.Tensor, dim: int) -> bool:
    if not isinstance(dim, int) or input.dim() == 0 or dim not in (-1, input.dim() - 1):
        return False
    return input.dim() >= 2 or is_sharded_on_last_dim(input)


def gather_replicated(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL,
                      full_size: Optional[int] = None) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's slice of the
    gradient (for downstream computation replicated over the group)."""
    _check_data_parallel_wrapper()
    return torch.ops.shard.gather_replicated(input, dim, group, full_size)


def all_gather(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL,
               full_size: Optional[int] = None) -> torch.Tensor:
    _check_data_parallel_wrapper()
    return torch.ops.shard.all_gather(input, dim, group, full_size)


def reduce_scatter(input: torch.Tensor, dim: int = -1, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    _check_data_parallel_wrapper()
    return torch.ops.shard.reduce_scatter(input, dim, group)
