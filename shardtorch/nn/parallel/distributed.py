"""``ts.nn.parallel.DistributedDataParallel``: torch's DDP set up so that data
parallelism around tensor-parallel layers stays exact, for either layout."""
from typing import List

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ...distributed import collectives
from ...distributed import state
from ...utils.fsdp_detection import fully_sharded_part
from .sharded_gradients import ShardedGradientAverager
from .sharded_parameters import sharded_parameter_names, sharded_parameters

HYBRID = "hybrid"
TWO_D = "2d"
LAYOUTS = (HYBRID, TWO_D)


def DistributedDataParallel(module: nn.Module, layout: str = HYBRID, **ddp_kwargs) -> TorchDDP:
    """Wraps ``module`` in torch's DistributedDataParallel for a layout.

    ``layout="hybrid"``: DDP over the world, every rank with its own samples,
    the batch gathered with ``ts.distributed.gather(x, dim=0)`` before the
    sharded layers (TorchShard's recipe). Sharded parameters are left out of
    the world DDP (their values differ per rank: DDP's broadcast would
    overwrite them and its averaging would mix different shards); they are
    broadcast from the first rank of their data-parallel group now, and their
    gradients are averaged over the data-parallel group after every
    synchronising backward (``no_sync()`` respected), by a
    ``ShardedGradientAverager`` kept as ``ddp.sharded_gradient_averager``.
    Everything else (backbone, replicated parameters of the head, the whole
    bias of a row-parallel layer) is left to the world DDP, which is exact for
    them thanks to the adjoint gather.

    ``layout="2d"``: every rank of a tensor-parallel group sees the same
    samples (``ts.utils.data.DistributedGroupSampler``); plain DDP over the
    data-parallel group is exact for every parameter. The replicated
    (unsharded) parameters and buffers are first broadcast from the first
    rank of each tensor-parallel group, because that DDP never sees the
    tensor-parallel peers and they must hold the same replica.

    Args:
        module: the model, with its ParallelLinear (or other marked) layers.
        layout: "hybrid" or "2d".
        **ddp_kwargs: passed to torch.nn.parallel.DistributedDataParallel
            (device_ids, bucket_cap_mb, find_unused_parameters, ...), except
            ``process_group``, which the layout decides.

    Returns:
        A torch.nn.parallel.DistributedDataParallel.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"DistributedDataParallel: layout must be one of {LAYOUTS}, got {layout!r}")
    if "process_group" in ddp_kwargs:
        raise ValueError("DistributedDataParallel: process_group is decided by the layout (the world for "
                         "'hybrid', the data-parallel group for '2d'); do not pass it, got "
                         f"{ddp_kwargs['process_group']!r}")
    state._require("nn.parallel.DistributedDataParallel")
    sharded_by_fsdp = fully_sharded_part(module)
    if sharded_by_fsdp:
        raise TypeError(f"DistributedDataParallel: module is already data-parallel under fully_shard "
                        f"({sharded_by_fsdp}): use one of DDP or fully_shard (ts.nn.parallel.fully_shard), not both")
    if layout == TWO_D:
        return _two_d(module, ddp_kwargs)
    return _hybrid(module, ddp_kwargs)


def _hybrid(module: nn.Module, ddp_kwargs: dict) -> TorchDDP:
    names = sharded_parameter_names(module)
    already_ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    TorchDDP._set_params_and_buffers_to_ignore_for_model(module, sorted(set(already_ignored + names)))
    sharded = sharded_parameters(module)
    data_parallel_group = state.get_data_parallel_group()
    _broadcast_from_first_rank(sharded, data_parallel_group)
    ddp = TorchDDP(module, **ddp_kwargs)
    averager = None
    if sharded and dist.get_world_size(data_parallel_group) > 1:
        averager = ShardedGradientAverager(ddp, sharded, data_parallel_group)
    ddp.sharded_gradient_averager = averager
    return ddp


def _two_d(module: nn.Module, ddp_kwargs: dict) -> TorchDDP:
    # A DDP over the data-parallel group holds one copy of each shard and
    # averages it exactly: the shards that register_ddp_parameters_to_ignore
    # (or a converter) asked a world DDP to leave alone go back to it.
    if hasattr(module, "_ddp_params_and_buffers_to_ignore"):
        names = set(sharded_parameter_names(module))
        TorchDDP._set_params_and_buffers_to_ignore_for_model(
            module, [n for n in module._ddp_params_and_buffers_to_ignore if n not in names])
    shards = {id(p) for p in sharded_parameters(module)}
    replicated = [p for p in module.parameters() if id(p) not in shards]
    _broadcast_from_first_rank(replicated + list(module.buffers()), state.get_group(state.TENSOR_PARALLEL))
    ddp = TorchDDP(module, process_group=state.get_data_parallel_group(), **ddp_kwargs)
    ddp.sharded_gradient_averager = None
    return ddp


@torch.no_grad()
def _broadcast_from_first_rank(tensors: List[torch.Tensor], group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)
    for tensor in tensors:
        collectives.broadcast(tensor.data, src=source, group=group)
