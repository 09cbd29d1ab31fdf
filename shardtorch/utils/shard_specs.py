"""How a tensor-parallel shard is described, and the record of a module's shards read back.

``ShardSpec`` and ``split_pieces`` say which pieces of the whole tensor a rank's shard holds
(shard_facts.py's docstring explains the splits); ``registered_shards`` and
``named_parameter_shards`` read what ``register_shard`` (shard_facts.py) recorded on each module.
Reading sits a layer below writing: ``register_shard`` also installs the state-dict hooks of
dcp_marks.py, which use the checkpoint code's layouts and transfers (checkpoint/layout.py,
checkpoint/transfers.py), and those read the shards through this module; so nothing here imports
them.
"""
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..distributed import state
from .parallel_dim import parameter_split_dim
from .shards import shard_range

SPECS_ATTR = "_shardtorch_shard_specs"  # {parameter name: ShardSpec} in the module's __dict__


@dataclass(frozen=True)
class ShardSpec:
    """One sharded parameter: ``dim`` of the (unsharded) parameter tensor is
    split over ``group``, whose whole length along it is ``full_size``
    (None: not recorded, to be asked of the group). ``blocks`` and ``unit``
    describe a head-aligned or fused split (shard_facts.py's docstring); 1 and 1: the
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


def check_parts(parts) -> Tuple[Tuple[int, int], ...]:
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
    shard_facts.py's docstring): [(offset, length)] in the order the shard stores
    them. A rank that holds nothing of a part has no piece of it (one empty
    piece where it holds nothing at all)."""
    if parts is None:
        if full_size % (blocks * unit) != 0:
            raise ValueError(f"split_pieces: full_size {full_size} is not blocks ({blocks}) x unit ({unit}) x an "
                             f"integer number of units")
        parts = ((full_size // blocks, unit),) * blocks
    else:
        parts = check_parts(parts)
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


def registered_shards(module: nn.Module) -> Dict[str, ShardSpec]:
    """{parameter name: ShardSpec} recorded on ``module`` itself (not its children)."""
    return dict(module.__dict__.get(SPECS_ATTR, {}))


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
        specs = module.__dict__.get(SPECS_ATTR, {})
        for name, param in module._parameters.items():
            if param is None:
                continue
            spec = specs.get(name) or _spec_from_tensor_mark(module, name, param)
            if spec is not None:
                yield (f"{prefix}.{name}" if prefix else name), param, spec
