"""Where each state-dict entry of a model lives: sharded (which dimension, over
which group, the full shape and every rank's slice) or replicated.

Which parameters are sharded, along which dimension and over which group, is
read from the modules that own them (shardtorch.utils.shard_facts), so it
survives wrappers that replace the parameter tensors. Full sizes are not
guessed from the local shape (a shard of 2 rows may come from 7 rows over 4
ranks or 8 over 4): the group's members exchange their local sizes, one small
all-gather per group for all entries at once, and the sizes are checked
against the split rule (and against the size the layer recorded, if any).

Under fully_shard (FSDP2) an entry is a DTensor whose shape is what the rank
would hold without it; its layout is that of this shape, and ``fsdp`` keeps
the DTensor's mesh and placements (dtensor_entries.py).
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..distributed import collectives, state
from ..utils.shard_specs import ShardSpec, named_parameter_shards, split_pieces
from ..utils.shards import shard_range
from .dtensor_entries import Spec, check_mesh, dtensor_spec


@dataclass(frozen=True)
class EntryLayout:
    """One state-dict entry as this rank holds it."""
    key: str
    local_shape: Tuple[int, ...]
    full_shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    dim: Optional[int] = None            # split dimension; None: replicated
    group: Optional[str] = None          # shardtorch group name
    group_rank: int = 0
    group_size: int = 1
    fsdp: Optional[Spec] = field(default=None, compare=False)  # under fully_shard: (mesh, placements)
    blocks: int = 1                      # a head-aligned or fused split (shardtorch.utils.shard_facts)
    unit: int = 1
    parts: Optional[Tuple[Tuple[int, int], ...]] = None  # fused parts of their own sizes (shard_facts)

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    @property
    def contiguous(self) -> bool:
        """Whether every rank holds one contiguous slice by the plain split rule."""
        return self.blocks == 1 and self.unit == 1 and self.parts is None

    def slice_of(self, group_rank: int) -> Tuple[int, int]:
        """(offset, length) along ``dim`` held by ``group_rank`` (a contiguous split only)."""
        if not self.contiguous:
            raise NotImplementedError(
                f"state dict entry {self.key!r} is split by whole heads ({self.blocks} fused part(s) of "
                f"{self.unit}-element heads, ts.nn.parallelize), not in one slice per rank: use pieces_of")
        start, stop = shard_range(self.full_shape[self.dim], self.group_size, group_rank)
        return start, stop - start

    def pieces_of(self, group_rank: int) -> List[Tuple[int, int]]:
        """[(offset along ``dim`` in the full tensor, length)] held by
        ``group_rank``, in the order its shard stores them."""
        return split_pieces(self.full_shape[self.dim], self.group_size, group_rank, self.blocks, self.unit,
                            self.parts)

    def shard_shape(self, group_rank: int) -> Tuple[int, ...]:
        """The shape of the shard ``group_rank`` holds."""
        shape = list(self.full_shape)
        shape[self.dim] = sum(length for _, length in self.pieces_of(group_rank))
        return tuple(shape)

    def take(self, full: torch.Tensor, group_rank: int) -> torch.Tensor:
        """``group_rank``'s shard of the full tensor (a view when it is one slice)."""
        pieces = [full.narrow(self.dim, offset, length) for offset, length in self.pieces_of(group_rank)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)

    def place(self, full: torch.Tensor, shard: torch.Tensor, group_rank: int) -> None:
        """Copies ``group_rank``'s shard into its places in the full tensor."""
        start = 0
        for offset, length in self.pieces_of(group_rank):
            full.narrow(self.dim, offset, length).copy_(shard.narrow(self.dim, start, length))
            start += length


def _sharded_entries(model: torch.nn.Module) -> Dict[str, ShardSpec]:
    """{state-dict key: its ShardSpec} for every sharded parameter."""
    return {key: spec for key, _, spec in named_parameter_shards(model)}


def model_layout(model: torch.nn.Module, state_dict: Optional[dict] = None) -> Dict[str, EntryLayout]:
    """The layout of every entry of ``state_dict`` (default: the model's own).

    Collective over every group that holds sharded entries: every rank of the
    world must call it with the same model structure.
    """
    if state_dict is None:
        state_dict = model.state_dict()
    sharded = _sharded_entries(model)
    by_group: Dict[str, List[str]] = {}
    for key, spec in sharded.items():
        if key in state_dict:
            by_group.setdefault(spec.group, []).append(key)
    full_sizes = {}
    # Every rank walks the groups in the same (sorted) order.
    for group, keys in sorted(by_group.items()):
        full_sizes.update(_exchange_full_sizes(state_dict, {k: sharded[k] for k in keys}, group))
    layout = {}
    for key, tensor in state_dict.items():
        shape = tuple(tensor.shape)
        fsdp = dtensor_spec(tensor)
        if key in full_sizes:
            spec = sharded[key]
            check_mesh(key, fsdp, spec.group, _ranks_holding_the_same_shard(spec.group))
            full = list(shape)
            full[spec.dim] = full_sizes[key]
            layout[key] = EntryLayout(key, shape, tuple(full), tensor.dtype, tensor.device, spec.dim, spec.group,
                                      state.get_group_rank(spec.group), state.get_group_size(spec.group), fsdp,
                                      spec.blocks, spec.unit, spec.parts)
        else:
            layout[key] = EntryLayout(key, shape, shape, tensor.dtype, tensor.device, fsdp=fsdp)
    return layout


def _ranks_holding_the_same_shard(group: str) -> List[int]:
    """The global ranks that hold this rank's shard of an entry split over ``group``."""
    if group == state.TENSOR_PARALLEL:
        return state.get_group_ranks(state.DATA_PARALLEL)
    return [state.get_rank()]


_MAX_DIMS = 8  # shapes travel padded to this many dimensions, so every rank sends the same length


def _exchange_full_sizes(state_dict, specs: Dict[str, ShardSpec], group: str) -> Dict[str, int]:
    size = state.get_group_size(group)
    keys = list(specs)
    dims = {k: spec.dim for k, spec in specs.items()}
    shapes = [tuple(state_dict[k].shape) for k in keys]
    if size == 1:
        return {k: shape[dims[k]] for k, shape in zip(keys, shapes)}
    local = torch.full((len(keys), _MAX_DIMS + 1), -1, dtype=torch.int64)
    for row, shape in enumerate(shapes):
        if len(shape) > _MAX_DIMS:
            raise ValueError(f"state dict entry {keys[row]!r}: shards of more than {_MAX_DIMS} dimensions are "
                             f"not supported, got shape {shape}")
        local[row, 0] = len(shape)
        local[row, 1:len(shape) + 1] = torch.tensor(shape, dtype=torch.int64)
    everyone = [torch.empty_like(local) for _ in range(size)]
    # The group's CPU process group is Gloo (shardtorch registers one for every group).
    collectives.all_gather(everyone, local, group=state.get_group(group))
    every_shape = torch.stack(everyone)  # [group rank, entry, 1 + dims]
    result = {}
    for column, key in enumerate(keys):
        dim = dims[key]
        per_rank_shapes = [tuple(int(n) for n in row[1:int(row[0]) + 1]) for row in every_shape[:, column]]
        others = {shape[:dim] + shape[dim + 1:] if len(shape) > dim else shape for shape in per_rank_shapes}
        if len(others) != 1 or any(len(shape) <= dim for shape in per_rank_shapes):
            # The shards differ in a dimension that was not split: the mark names the wrong dimension
            # (or the ranks hold different models). Gathering them would mix unrelated slices.
            raise RuntimeError(
                f"state dict entry {key!r}: its shards over group {group!r} are split along dim {dim}, but their "
                f"shapes per group rank, {per_rank_shapes}, differ in another dimension (does the parallel mark "
                f"name the dimension that was split? see docs/torchshard.md)")
        per_rank = [shape[dim] for shape in per_rank_shapes]
        total = sum(per_rank)
        spec = specs[key]
        # The lengths the split's pieces give (a head-aligned or fused split holds whole heads of every part).
        expected = spec.local_lengths(total, size)
        if per_rank != expected:
            raise RuntimeError(
                f"state dict entry {key!r}: shard sizes along dim {dim} over group {group!r} "
                f"are {per_rank}, which break the split rule for a total of {total} "
                + ("" if spec.plain else f"in parts {spec.parts} " if spec.parts is not None
                   else f"in grains of {spec.blocks * spec.unit} ")
                + f"(expected {expected})")
        if spec.full_size is not None and spec.full_size != total:
            raise RuntimeError(
                f"state dict entry {key!r}: its layer records a full size of {spec.full_size} along dim "
                f"{dim}, but the shards over group {group!r} add up to {total} ({per_rank})")
        result[key] = total
    return result
