"""What makes a parameter a tensor-parallel shard, kept on the module that owns it.

Wrappers replace tensor objects: fully_shard swaps parameters for DTensors,
state-dict round trips and deepcopy copy them, DDP and torch.compile wrap the
module. A Python attribute on a parameter is lost sooner or later; the
module's own attributes survive all of them (fully_shard changes the module's
class, not its ``__dict__``). So a parallel layer records, for each of its
sharded parameters by name, which tensor dimension was split, the whole
length along it and the group; every shardtorch function that needs to know
(checkpoints, the DDP wrapper, converters) reads it from here through
``named_parameter_shards``.

A parameter that no module registered but that carries a parallel mark on the
tensor (``ts.register_parallel_dim`` / ``ts.set_attribute``, the way
hand-written TorchShard-style layers mark theirs) is read from that mark, with
TorchShard's meaning (the layer's dim and ``order_type``, translated by
``shardtorch.utils.parallel_dim.parameter_split_dim``), its full size unknown
(the checkpoint code then asks the group for it).
"""
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from ..distributed import state
from .parallel_dim import parameter_split_dim

_SPECS_ATTR = "_shardtorch_shard_specs"


@dataclass(frozen=True)
class ShardSpec:
    """One sharded parameter: ``dim`` of the (unsharded) parameter tensor is
    split over ``group``, whose whole length along it is ``full_size``
    (None: not recorded, to be asked of the group)."""
    dim: int
    full_size: Optional[int]
    group: str


def register_shard(module: nn.Module, name: str, dim: int, full_size: int,
                   group: str = state.TENSOR_PARALLEL) -> None:
    """Records that ``module``'s parameter ``name`` is this rank's slice of a
    tensor split along ``dim`` (non-negative) into ``full_size`` elements in all."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_shard: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise ValueError(f"register_shard: dim must be a non-negative int (a dimension of {name!r}), got {dim!r}")
    if not isinstance(full_size, int) or isinstance(full_size, bool) or full_size < 0:
        raise ValueError(f"register_shard: full_size must be a non-negative int, got {full_size!r}")
    if not isinstance(group, str):
        raise TypeError(f"register_shard: group must be a shardtorch group name (str), got {group!r}")
    specs = module.__dict__.setdefault(_SPECS_ATTR, {})
    specs[name] = ShardSpec(dim, full_size, group)


def unregister_shard(module: nn.Module, name: str) -> None:
    """Forgets that ``module``'s parameter ``name`` is a shard (if it was recorded)."""
    module.__dict__.get(_SPECS_ATTR, {}).pop(name, None)


def registered_shards(module: nn.Module) -> Dict[str, ShardSpec]:
    """{parameter name: ShardSpec} recorded on ``module`` itself (not its children)."""
    return dict(module.__dict__.get(_SPECS_ATTR, {}))


def _spec_from_tensor_mark(module: nn.Module, name: str, param: torch.Tensor) -> Optional[ShardSpec]:
    dim = parameter_split_dim(param, f"parameter {name!r} of {type(module).__name__}")
    if dim is None:
        return None
    group = getattr(module, "group", None)
    return ShardSpec(dim, None, group if isinstance(group, str) else state.TENSOR_PARALLEL)


def named_parameter_shards(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor, ShardSpec]]:
    """(full dotted name, parameter, ShardSpec) of every sharded parameter of
    ``model``, named as ``model.named_parameters(remove_duplicate=False)`` and
    ``model.state_dict()`` name them (wrapper prefixes such as ``module.`` or
    ``_orig_mod.`` included); a parameter reachable under several names (tied
    weights, shared modules) is yielded under each."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"named_parameter_shards: model must be a torch.nn.Module, got {type(model).__name__}")
    for prefix, module in model.named_modules(remove_duplicate=False):
        specs = module.__dict__.get(_SPECS_ATTR, {})
        for name, param in module._parameters.items():
            if param is None:
                continue
            spec = specs.get(name) or _spec_from_tensor_mark(module, name, param)
            if spec is not None:
                yield (f"{prefix}.{name}" if prefix else name), param, spec
