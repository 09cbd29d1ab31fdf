"""Which parameters of a model are shards: the ones a tensor-parallel layer
recorded on itself (see shardtorch.utils.shard_facts), or that carry a
parallel mark on the tensor (``shardtorch.utils.register_parallel_dim``)."""
from typing import Iterator, List, Tuple

import torch
from torch import nn

from ...utils.parallel_dim import parameter_split_dim
from ...utils.shard_facts import named_parameter_shards


def is_sharded_parameter(parameter: torch.Tensor) -> bool:
    """True when ``parameter`` carries a parallel mark on the tensor itself
    that says it is a shard (TorchShard's meaning: a whole bias of a
    row-parallel layer, marked 0, is not).

    The mark is lost when a wrapper replaces the tensor; to ask about the
    parameters of a model, use ``named_sharded_parameters(model)``, which also
    reads what the layers recorded on themselves."""
    return parameter_split_dim(parameter) is not None


def named_sharded_parameters(model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """(full dotted name, parameter) of every sharded parameter of ``model``,
    nested ones included. A parameter reachable under several names (tied
    weights) is yielded under each, because DDP matches names, not objects."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"named_sharded_parameters: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    for name, parameter, _ in named_parameter_shards(model):
        yield name, parameter


def sharded_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The sharded parameters of ``model``, each once, in ``model.parameters()`` order."""
    ids = {id(p) for _, p in named_sharded_parameters(model)}
    return [p for p in model.parameters() if id(p) in ids]


def sharded_parameter_names(model: nn.Module) -> List[str]:
    """Full dotted names of the sharded parameters of ``model``, the list that
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    takes, so that a DDP over ranks holding different shards neither
    broadcasts nor averages them."""
    return [name for name, _ in named_sharded_parameters(model)]
