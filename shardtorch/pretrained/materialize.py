"""Giving a parallelized meta model real (empty) tensors of its shard shapes.

``nn.Module.to_empty`` would also empty the tensors built for real (norms,
biases, the buffers the model computed), so only meta tensors are replaced;
a parameter shared by several modules (a tied LM head) stays one parameter.
"""
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from ..utils.dcp_marks import track_parameters


def named_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """{name: tensor} of every parameter and buffer, under every name it has (tied ones too)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def materialize(model: nn.Module, device,
                provide: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None) -> List[str]:
    """Replaces every meta parameter and buffer of ``model`` by an empty tensor
    of its shape and dtype on ``device``, or by ``provide(meta tensor)`` where
    that gives one; returns the names that were meta."""
    device = torch.device(device)
    replaced: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                new = replaced.get(id(tensor))
                if new is None:
                    empty = provide(tensor) if provide is not None else None
                    if empty is None:
                        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    new = nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(
                        tensor, nn.Parameter) else empty
                    replaced[id(tensor)] = new
                table[name] = new
    track_parameters(model)
    made = {id(t) for t in replaced.values()}
    return [name for name, tensor in named_tensors(model).items() if id(tensor) in made]
