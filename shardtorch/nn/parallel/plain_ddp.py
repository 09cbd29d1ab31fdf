"""Models with shards inside plain ``torch.nn.parallel.DistributedDataParallel``.

TorchShard's recipe wraps the model in torch's own DDP after
``ts.register_ddp_parameters_to_ignore(model)`` (or ``convert_parallel_linear``
/ ``convert_parallel_embedding``, which do it): DDP then neither broadcasts
nor averages the shards, whose values differ per rank. Left alone, their
gradients would not be averaged at all, which is exact only when every rank
of the world holds a different shard. So the first forward under a plain DDP
(``DistributedDataParallel._active_ddp_module``, which torch sets around the
wrapped module's forward) attaches, once per DDP, what
``ts.nn.parallel.DistributedDataParallel`` would have set up: the shards are
broadcast from the first rank of their data-parallel group and a
``ShardedGradientAverager`` averages their gradients over that group after
every synchronising backward. Training is then exact in both layouts:
"hybrid" (DDP over the world, the batch gathered before the head) and "2d"
(DDP over the data-parallel group).

A shard that a plain DDP did not ignore is fine when that DDP's group holds
no two ranks of the shard's group (the 2-D layout: DDP over the
data-parallel group, which holds one copy of each shard); otherwise DDP has
broadcast one rank's shard over the others and would average different
shards: the first forward raises, naming the parameter and the fix.

The check runs from the forward of the parallel layers and of the mappings
(``ts.distributed.copy``, ``scatter``, ...), which every sharded layer calls;
it costs one attribute read per call once done. Not under torch.compile or
TorchScript (run one eager step first) nor with DDP's Python reducer.
"""
from typing import List

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ...distributed import state
from ...distributed.mappings import set_data_parallel_check
from ...utils.shard_facts import named_parameter_shards
from .distributed import _broadcast_from_first_rank
from .sharded_gradients import ShardedGradientAverager

_CHECKED_ATTR = "_shardtorch_shards_checked"


def register_ddp_parameters_to_ignore(module: nn.Module) -> List[str]:
    """Tells torch's DistributedDataParallel, wrapped around ``module``
    afterwards, to leave its shards alone (TorchShard's function): the full
    names of its sharded parameters, set as
    ``module._ddp_params_and_buffers_to_ignore`` (added to any already there)
    and returned. Whole parameters that carry a mark (the bias of a
    row-parallel layer) stay with DDP, which averages them. Their gradients are
    averaged over the data-parallel group from the first forward under DDP on
    (see this module's docstring). Called on a DistributedDataParallel that
    already holds shards (too late: DDP reads the list when it is built), it
    raises."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_ddp_parameters_to_ignore: module must be a torch.nn.Module, got "
                        f"{type(module).__name__}")
    names = [name for name, _, _ in named_parameter_shards(module)]
    if isinstance(module, TorchDDP):
        held = [name for name in names if name[len("module."):] not in module.parameters_to_ignore]
        if held:
            raise ValueError(
                f"register_ddp_parameters_to_ignore: module is a DistributedDataParallel already built over the "
                f"shards {held}: it has broadcast one rank's shards over the others and averages different "
                f"shards. Call it on the model before wrapping it (DDP reads the list when it is built)")
    already = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    ignored = sorted(set(already + names))
    TorchDDP._set_params_and_buffers_to_ignore_for_model(module, ignored)
    return ignored


def check_active_ddp() -> None:
    """Called from the forward of sharded layers: checks, and completes, a
    plain torch DDP around the model the first time it runs."""
    ddp = TorchDDP._active_ddp_module
    if ddp is None or getattr(ddp, _CHECKED_ATTR, False) or torch.compiler.is_compiling():
        return
    if not hasattr(ddp, "sharded_gradient_averager"):  # else ts.nn.parallel.DistributedDataParallel set it up
        _complete(ddp)  # raises again at every forward of a DDP it refuses
    setattr(ddp, _CHECKED_ATTR, True)


set_data_parallel_check(check_active_ddp)  # the mappings (ts.distributed.copy, ...) call it too


def _complete(ddp: TorchDDP) -> None:
    ddp_ranks = set(dist.get_process_group_ranks(ddp.process_group))
    ignored = ddp.parameters_to_ignore
    left_to_us = []
    for name, param, spec in named_parameter_shards(ddp.module):
        if name in ignored:
            left_to_us.append(param)
            continue
        peers = ddp_ranks & set(state.get_group_ranks(spec.group))
        if len(peers) > 1:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {name!r} is a shard over group {spec.group!r} (split on "
                f"dim {spec.dim}), but the DDP around it spans ranks {sorted(peers)} of that group: DDP "
                f"broadcast one rank's shard over the others and would average different shards. Call "
                f"ts.register_ddp_parameters_to_ignore(model) before wrapping (convert_parallel_linear / "
                f"convert_parallel_embedding of the whole model do it), or wrap with "
                f"ts.nn.parallel.DistributedDataParallel(model, layout=...)")
    data_parallel = state.get_data_parallel_group()
    dp_ranks = set(dist.get_process_group_ranks(data_parallel))
    if left_to_us and not dp_ranks <= ddp_ranks:
        raise RuntimeError(
            f"DistributedDataParallel: its process group (ranks {sorted(ddp_ranks)}) must be the world or the "
            f"data-parallel group (ranks {sorted(dp_ranks)}) for the shards it ignores to be averaged over "
            f"the data-parallel group")
    averager = None
    if left_to_us and len(dp_ranks) > 1:
        _broadcast_from_first_rank(left_to_us, data_parallel)
        averager = ShardedGradientAverager(ddp, left_to_us, data_parallel)
        averager._on_forward(ddp, ())  # this forward is already under way
    ddp.sharded_gradient_averager = averager
