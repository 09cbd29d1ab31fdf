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
"""
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..distributed import state
from .parallel_dim import parameter_split_dim
from .shards import shard_range

_SPECS_ATTR = "_shardtorch_shard_specs"


@dataclass(frozen=True)
class ShardSpec:
    """One sharded parameter: ``dim`` of the (unsharded) parameter tensor is
    split over ``group``, whose whole length along it is ``full_size``
    (None: not recorded, to be asked of the group). ``blocks`` and ``unit``
    describe a head-aligned or fused split (module docstring); 1 and 1: the
    plain split rule."""
    dim: int
    full_size: Optional[int]
    group: str
    blocks: int = 1
    unit: int = 1
    parts: Optional[Tuple[Tuple[int, int], ...]] = None

    @property
    def plain(self) -> bool:
        return self.blocks == 1 and self.unit == 1 and self.parts is None

    def pieces(self, full_size: int, group_size: int, group_rank: int) -> List[Tuple[int, int]]:
        """[(offset along dim in the whole tensor, length)] that ``group_rank``
        holds, in the order its shard stores them."""
        return split_pieces(full_size, group_size, group_rank, self.blocks, self.unit, self.parts)

    def local_lengths(self, full_size: int, group_size: int) -> Optional[List[int]]:
        """The length along ``dim`` of every group rank's shard of a tensor of
        ``full_size``, or None where that size does not fit this split."""
        try:
            return [sum(length for _, length in self.pieces(full_size, group_size, rank))
                    for rank in range(group_size)]
        except ValueError:
            return None


def _check_parts(parts) -> Tuple[Tuple[int, int], ...]:
    if not isinstance(parts, (tuple, list)) or not parts:
        raise ValueError(f"split_pieces: parts must be a non-empty tuple of (length, unit) pairs, got {parts!r}")
    checked = []
    for part in parts:
        if (not isinstance(part, (tuple, list)) or len(part) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in part)
                or part[0] < 0 or part[1] < 1 or part[0] % part[1] != 0):
            raise ValueError(f"split_pieces: each part must be (length, unit) with length a non-negative "
                             f"multiple of a positive unit, got {part!r} in {parts!r}")
        checked.append((part[0], part[1]))
    return tuple(checked)


def split_pieces(full_size: int, group_size: int, group_rank: int, blocks: int = 1,
                 unit: int = 1, parts: Optional[Tuple[Tuple[int, int], ...]] = None) -> List[Tuple[int, int]]:
    """The pieces of a ``blocks x units x unit`` split, or of ``parts`` (see
    the module docstring): [(offset, length)] in the order the shard stores
    them. A rank that holds nothing of a part has no piece of it (one empty
    piece where it holds nothing at all)."""
    if parts is None:
        if full_size % (blocks * unit) != 0:
            raise ValueError(f"split_pieces: full_size {full_size} is not blocks ({blocks}) x unit ({unit}) x an "
                             f"integer number of units")
        parts = ((full_size // blocks, unit),) * blocks
    else:
        parts = _check_parts(parts)
        if sum(length for length, _ in parts) != full_size:
            raise ValueError(f"split_pieces: the parts {parts} add up to {sum(n for n, _ in parts)}, not to "
                             f"full_size {full_size}")
    pieces, offset = [], 0
    for length, part_unit in parts:
        start, stop = shard_range(length // part_unit, group_size, group_rank)
        if stop > start:
            pieces.append((offset + start * part_unit, (stop - start) * part_unit))
        offset += length
    return pieces or [(0, 0)]


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
        parts = _check_parts(parts)
        if sum(length for length, _ in parts) != full_size:
            raise ValueError(f"register_shard: the parts of {name!r} ({parts}) must add up to full_size "
                             f"({full_size})")
    elif full_size % (blocks * unit) != 0:
        raise ValueError(f"register_shard: full_size ({full_size}) must be a multiple of blocks x unit "
                         f"({blocks} x {unit}) for {name!r}")
    specs = module.__dict__.setdefault(_SPECS_ATTR, {})
    specs[name] = ShardSpec(dim, full_size, group, blocks, unit, parts)
    from .dcp_marks import track  # its state-dict entries tell torch.distributed.checkpoint their place
    track(module, name, specs[name])


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
