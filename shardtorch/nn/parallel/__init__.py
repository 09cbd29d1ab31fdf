"""Data parallelism around tensor-parallel models (``ts.nn.parallel``).

Two layouts are exact (training equals unsharded training on the global batch):

- "hybrid": torch DDP over the world (every rank its own samples); the batch
  is gathered with ``ts.distributed.gather(x, dim=0)`` before the sharded
  layers; sharded parameters are left out of the world DDP and their gradients
  are averaged over the data-parallel group.
- "2d": every rank of a tensor-parallel group sees the same samples
  (``ts.utils.data.DistributedGroupSampler``); torch DDP over the
  data-parallel group.

Either layout also runs on torch's FSDP2 instead of DDP: ``fully_shard(model,
layout=...)`` shards parameters, gradients and optimizer state over the
data-parallel dimension too (fsdp_layouts.py).
"""
from .distributed import LAYOUTS, DistributedDataParallel
from .fsdp_layouts import fully_shard
from .plain_ddp import register_ddp_parameters_to_ignore
from .sharded_gradients import ShardedGradientAverager
from .sharded_parameters import (is_sharded_parameter, named_sharded_parameters, sharded_parameter_names,
                                 sharded_parameters)

__all__ = ["DistributedDataParallel", "LAYOUTS", "fully_shard", "register_ddp_parameters_to_ignore",
           "ShardedGradientAverager", "is_sharded_parameter",
           "named_sharded_parameters", "sharded_parameter_names", "sharded_parameters"]
