"""Checkpoints of sharded models (``ts.collect_state_dict``, ...).

- collect_state_dict / relocate_state_dict: the unsharded model's state dict,
  gathered from the shards / cut back into them (one file, any group size).
- collect_optimizer_state_dict / relocate_optimizer_state_dict: the same for
  an optimizer's state (momentum, Adam moments, step), sharded like the
  parameters; collected, it loads into the plain torch optimizer.
- save_sharded / load_sharded: each rank writes its own shards with metadata
  (and the optimizer's, given ``optimizer=``); the loader reshards to any group
  size (models too big to gather).
- save_pretrained: a Hugging Face checkpoint of the unsharded model, written
  tensor by tensor (``model.save_pretrained`` of a parallelized model calls it).
- save_dcp / load_dcp / dcp_state_dict: the same through
  torch.distributed.checkpoint, shards described as ShardedTensors.
"""
from .collect import collect_state_dict
from .dcp import dcp_state_dict, load_dcp, save_dcp
from ..pretrained.save import SavePretrainedError, save_pretrained  # the home of loading and saving pretrained models
from .optimizer import (OptimizerStateMismatchError, collect_optimizer_state_dict,
                        load_sharded_optimizer_state_dict, relocate_optimizer_state_dict)
from .relocate import relocate_state_dict
from .sharded_format import CheckpointFormatError
from .sharded_load import load_sharded, load_sharded_state_dict
from .sharded_save import SaveFailedError, save_sharded
from .verify import CheckpointMismatchError

__all__ = ["collect_state_dict", "relocate_state_dict", "collect_optimizer_state_dict",
           "relocate_optimizer_state_dict", "load_sharded_optimizer_state_dict", "OptimizerStateMismatchError",
           "save_sharded", "load_sharded",
           "load_sharded_state_dict", "CheckpointMismatchError", "CheckpointFormatError",
           "SaveFailedError", "dcp_state_dict", "save_dcp", "load_dcp", "save_pretrained", "SavePretrainedError"]
