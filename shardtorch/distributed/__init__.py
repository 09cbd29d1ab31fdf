"""Process groups and communication mappings (``ts.distributed``)."""
from . import clean_exit  # noqa: F401  (registers the exit handler)
from .mappings import all_gather, copy, gather, gather_replicated, reduce, reduce_scatter, scatter
from .state import (DATA_PARALLEL, TENSOR_PARALLEL, WORLD, check_deferred, destroy_process_group, device_mesh,
                    get_data_parallel_group, get_data_parallel_rank, get_data_parallel_size, get_group, get_group_rank,
                    get_group_ranks, get_group_size, get_rank, get_world_size, init_process_group, register_group,
                    is_initialized)

__all__ = [
    "init_process_group", "destroy_process_group", "check_deferred", "device_mesh", "register_group", "is_initialized",
    "get_rank", "get_world_size",
    "get_group", "get_group_rank", "get_group_ranks", "get_group_size", "get_data_parallel_group",
    "get_data_parallel_rank", "get_data_parallel_size", "copy", "reduce", "scatter", "gather", "gather_replicated",
    "all_gather", "reduce_scatter", "TENSOR_PARALLEL", "DATA_PARALLEL", "WORLD",
]
