"""A shard described for torch.distributed.checkpoint: a ShardedTensor with
a local shard per piece the rank holds (one for a plain split; one per fused
part for heads taken from each part of a fused q/k/v projection), each
knowing its place in the full tensor.

DTensor cannot say where a shard sits under shardtorch's split rule (the first
n % size ranks hold one more; DTensor's Shard(dim) follows torch.chunk), so
the model's entries (dcp.py) and the optimizer's (optimizer/dcp.py) are both
described this way.
"""
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

from ..distributed import state
from .layout import EntryLayout


def as_sharded_tensor(tensor: torch.Tensor, entry: EntryLayout):
    """``tensor`` (this rank's shard of ``entry``) as a ShardedTensor over its
    group. Pieces that are contiguous views share storage with ``tensor`` (DCP
    loads straight into them); the others are copies: ``copy_back`` puts
    what DCP loaded into them back into ``tensor``."""
    device = "cpu" if tensor.device.type == "cpu" else f"{tensor.device.type}:{tensor.device.index or 0}"
    shards = []
    at = 0
    for offset, length in entry.pieces_of(entry.group_rank):
        piece = tensor.narrow(entry.dim, at, length)
        at += length
        if length == 0:
            continue
        offsets = [0] * tensor.dim()
        offsets[entry.dim] = offset
        metadata = ShardMetadata(shard_offsets=offsets, shard_sizes=list(piece.shape),
                                 placement=f"rank:{dist.get_rank()}/{device}")
        shards.append(Shard(piece if piece.is_contiguous() else piece.contiguous(), metadata))
    return init_from_local_shards(shards, *entry.full_shape, process_group=state.get_group(entry.group))


def copy_back(sharded, tensor: torch.Tensor, entry: EntryLayout) -> None:
    """Copies the pieces of ``sharded`` (from ``as_sharded_tensor(tensor, entry)``) that are copies into ``tensor``."""
    by_offset = {shard.metadata.shard_offsets[entry.dim]: shard.tensor for shard in sharded.local_shards()}
    at = 0
    for offset, length in entry.pieces_of(entry.group_rank):
        piece = tensor.narrow(entry.dim, at, length)
        at += length
        source = by_offset.get(offset)
        if source is not None and source.data_ptr() != piece.data_ptr():
            piece.copy_(source)
