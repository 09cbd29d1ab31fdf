from . import data
from .parallel_dim import (get_parallel_dim, get_parallel_full_size, parameter_split_dim, register_parallel_attribute,
                           register_parallel_dim, set_attribute)
from .shard_facts import register_shard, registered_shards, unregister_shard

__all__ = ["data", "get_parallel_dim", "get_parallel_full_size", "parameter_split_dim", "register_parallel_attribute",
           "register_parallel_dim", "register_shard", "registered_shards", "set_attribute", "unregister_shard"]
