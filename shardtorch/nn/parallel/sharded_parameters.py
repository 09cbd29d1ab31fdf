"""Which parameters of a model are shards: the ones a tensor-parallel layer
marked with a ``parallel_dim`` (see shardtorch.utils.parallel_dim)."""
from typing import Iterator, List, Tuple

import torch
from torch import nn

from ...utils.parallel_dim import get_parallel_dim


def is_sharded_parameter(parameter: torch.Tensor) -> bool:
    """True when ``parameter`` holds this rank's slice of a larger tensor,
    so that its value differs between the ranks of a tensor-parallel group."""
    return get_parallel_dim(parameter) is not None


def named_sharded_parameters(model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """(full dotted name, parameter) of every sharded parameter of ``model``,
    nested ones included. A parameter reachable under several names (tied
    weights) is yielded under each, because DDP matches names, not objects."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"named_sharded_parameters: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if is_sharded_parameter(parameter):
            yield name, parameter


def sharded_parameter_names(model: nn.Module) -> List[str]:
    """Full dotted names of the sharded parameters of ``model``, the list that
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    takes, so that a DDP over ranks holding different shards neither
    broadcasts nor averages them."""
    return [name for name, _ in named_sharded_parameters(model)]
