"""Functional forms of the parallel layers (``ts.nn.functional``)."""
from typing import Optional

import torch

from .. import _core  # noqa: F401  (registers the ops)
from ..distributed.state import TENSOR_PARALLEL


def parallel_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    dim: Optional[int] = None, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    """y = input weight^T + bias with ``weight`` this rank's shard; see
    ParallelLinear for ``dim``."""
    return torch.ops.shard.parallel_linear(input, weight, bias, dim, group)
