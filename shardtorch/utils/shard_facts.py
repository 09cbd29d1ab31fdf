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

A split need not be one contiguous slice per rank. Attention splits by whole
heads, and a fused projection (GPT-2's ``c_attn``, timm's ``qkv``) stacks
``blocks`` equal parts (q, k, v) along the split dimension, each of them
split the same way: the dimension is ``blocks x units x unit`` (``unit``
elements per head, ``units`` heads per part), and a group rank holds, from
every part, the heads ``shard_range(units, size, rank)`` gives it. With
``blocks = unit = 1`` (the default) this is the plain split rule.

Parts need not be equal: ``parts``, a tuple of ``(length, unit)`` pairs in
the order they lie along the dimension, describes parts of different sizes
and head sizes (Phi-3's fused ``qkv_proj`` under grouped-query attention:
the query part holds ``heads x head_dim`` rows, the key and value parts
``kv_heads x head_dim`` each; with the query heads taken in groups of
``heads / kv_heads`` every part has ``kv_heads`` units and a rank holds the
same key/value heads' rows from each). Each part is split by
``shard_range(length // unit, size, rank)`` on its own, so a part with
fewer units than ranks (the single key/value head of multi-query attention)
lies whole on the first ranks and not at all on the others: the pieces of
the ranks never overlap and together cover the tensor once. Blocks and unit
are the special case ``parts = ((length / blocks, unit),) * blocks``.

A parameter that no module registered but that carries a parallel mark on the
tensor (``ts.register_parallel_dim`` / ``ts.set_attribute``, the way
hand-written TorchShard-style layers mark theirs) is read from that mark, with
TorchShard's meaning (the layer's dim and ``order_type``, translated by
``shardtorch.utils.parallel_dim.parameter_split_dim``), its full size unknown
(the checkpoint code then asks the group for it).

This module writes the record (``register_shard``); the description of a split and the reading of
the record (``ShardSpec``, ``split_pieces``, ``registered_shards``, ``named_parameter_shards``) live a
layer below, in shard_specs.py, and are named here too.
"""
from typing import Optional, Tuple

from torch import nn

from ..distributed import state
from .dcp_marks import track
from .shard_specs import (SPECS_ATTR, ShardSpec, check_parts, named_parameter_shards, registered_shards,  # noqa: F401
                          split_pieces)


def register_shard(module: nn.Module, name: str, dim: int, full_size: int,
                   group: str = state.TENSOR_PARALLEL, blocks: int = 1, unit: int = 1,
                   parts: Optional[Tuple[Tuple[int, int], ...]] = None) -> None:
    """Records that ``module``'s parameter ``name`` is this rank's slice of a
    tensor split along ``dim`` (non-negative) into ``full_size`` elements in all
    (``blocks`` fused parts of heads of ``unit`` elements each, or ``parts`` of
    their own lengths and units: see the module docstring)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_shard: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise ValueError(f"register_shard: dim must be a non-negative int (a dimension of {name!r}), got {dim!r}")
    if not isinstance(full_size, int) or isinstance(full_size, bool) or full_size < 0:
        raise ValueError(f"register_shard: full_size must be a non-negative int, got {full_size!r}")
    if not isinstance(group, str):
        raise TypeError(f"register_shard: group must be a shardtorch group name (str), got {group!r}")
    for what, value in (("blocks", blocks), ("unit", unit)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"register_shard: {what} must be a positive int, got {value!r}")
    if parts is not None:
        if (blocks, unit) != (1, 1):
            raise ValueError(f"register_shard: give either parts or blocks and unit for {name!r}, got parts "
                             f"{parts!r} with blocks {blocks} and unit {unit}")
        parts = check_parts(parts)
        if sum(length for length, _ in parts) != full_size:
            raise ValueError(f"register_shard: the parts of {name!r} ({parts}) must add up to full_size "
                             f"({full_size})")
    elif full_size % (blocks * unit) != 0:
        raise ValueError(f"register_shard: full_size ({full_size}) must be a multiple of blocks x unit "
                         f"({blocks} x {unit}) for {name!r}")
    specs = module.__dict__.setdefault(SPECS_ATTR, {})
    specs[name] = ShardSpec(dim, full_size, group, blocks, unit, parts)
    track(module, name, specs[name])  # its state-dict entries tell torch.distributed.checkpoint their place


def unregister_shard(module: nn.Module, name: str) -> None:
    """Forgets that ``module``'s parameter ``name`` is a shard (if it was recorded)."""
    module.__dict__.get(SPECS_ATTR, {}).pop(name, None)
