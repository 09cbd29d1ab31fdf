"""``ts.nn.RegisterParallelDim``: TorchShard's module that marks what passes through."""
from typing import Optional

import torch
from torch import nn

from ..utils.parallel_dim import set_attribute


class RegisterParallelDim(nn.Module):
    """Returns its input (a tensor, or a list / tuple of tensors) marked with
    ``parallel_dim = dim`` (see shardtorch.utils.parallel_dim): ``dim=-1``
    between a column-parallel and a row-parallel layer (with an activation in
    between that drops the mark) says that the tensor is sharded on its last
    dim; ``dim=None`` removes the mark."""

    __constants__ = ["dim"]

    def __init__(self, dim: Optional[int] = None) -> None:
        super().__init__()
        set_attribute(torch.empty(0), dim)  # checks dim
        self.dim = dim

    def forward(self, x):
        tensors = x if isinstance(x, (list, tuple)) else [x]
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"RegisterParallelDim: input must be a tensor or a list / tuple of tensors, "
                                f"got {type(tensor).__name__}")
            set_attribute(tensor, self.dim)
        return x

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
