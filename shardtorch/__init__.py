"""shardtorch: tensor-parallel layers and losses for PyTorch with a C++/CUDA core.

    import shardtorch as ts
    ts.distributed.init_process_group(group_size=2)
    layer = ts.nn.ParallelLinear(512, 1_000_000, dim=1)
"""
import os as _os

import torch as _torch

from . import _C  # loads libshardtorch.so, which registers the torch.ops.shard.* operators
from . import checkpoint, distributed, nn, optim, random, utils
from .checkpoint import (collect_optimizer_state_dict, collect_state_dict, load_sharded, load_sharded_state_dict,
                         relocate_optimizer_state_dict, relocate_state_dict, save_sharded)
# TorchShard 0.1.0's top-level names (docs/torchshard.md).
from .nn.parallel.plain_ddp import register_ddp_parameters_to_ignore
from .one_process import TensorParallelModel, tensor_parallel
from .utils.parallel_dim import (ORDER_ATTR as _ORDER_ATTR, PARALLEL_DIM_ATTR as _PARALLEL_DIM, get_parallel_dim,
                                 register_parallel_attribute, register_parallel_dim, set_attribute)
from .utils.tensor_slice import slice

#: (major, minor) of the torch in use, as TorchShard's ``TORCH_VERSION``.
TORCH_VERSION = tuple(int(x) for x in _torch.__version__.split("+")[0].split(".")[:2])

__version__ = _C.version
cuda_built = _C.cuda_built
#: Prefix for CMake's find_package(shardtorch) from C++ programs.
cmake_prefix_path = _os.path.dirname(_os.path.abspath(__file__))

__all__ = ["checkpoint", "distributed", "nn", "optim", "random", "utils", "tensor_parallel", "TensorParallelModel", "collect_state_dict", "relocate_state_dict",
           "collect_optimizer_state_dict", "relocate_optimizer_state_dict", "save_sharded", "load_sharded",
           "load_sharded_state_dict", "cmake_prefix_path", "cuda_built", "__version__", "TORCH_VERSION",
           "register_ddp_parameters_to_ignore", "get_parallel_dim", "register_parallel_dim",
           "register_parallel_attribute", "set_attribute", "slice"]
