"""Checkpoints of sharded models (``ts.collect_state_dict``, ...).

- collect_state_dict / relocate_state_dict: the unsharded model's state dict,
  gathered from the shards / cut back into them (one file, any group size).
- save_sharded / load_sharded: each rank writes its own shards with metadata;
  the loader reshards to any group size (models too big to gather).
- save_dcp / load_dcp / dcp_state_dict: the same through
  torch.distributed.checkpoint, shards described as ShardedTensors.
"""
from .collect import collect_state_dict
from .dcp import dcp_state_dict, load_dcp, save_dcp
from .relocate import relocate_state_dict
from .sharded_format import CheckpointFormatError
from .sharded_load import load_sharded, load_sharded_state_dict
from .sharded_save import SaveFailedError, save_sharded
from .verify import CheckpointMismatchError

__all__ = ["collect_state_dict", "relocate_state_dict", "save_sharded", "load_sharded",
           "load_sharded_state_dict", "CheckpointMismatchError", "CheckpointFormatError",
           "SaveFailedError", "dcp_state_dict", "save_dcp", "load_dcp"]
