"""A shard described for torch.distributed.checkpoint: a ShardedTensor with
one local shard that knows its place in the full tensor.

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
    group; shares storage with ``tensor``, so DCP loads straight into it."""
    offsets = [0] * tensor.dim()
    offsets[entry.dim] = entry.slice_of(entry.group_rank)[0]
    device = "cpu" if tensor.device.type == "cpu" else f"{tensor.device.type}:{tensor.device.index or 0}"
    metadata = ShardMetadata(shard_offsets=offsets, shard_sizes=list(tensor.shape),
                             placement=f"rank:{dist.get_rank()}/{device}")
    return init_from_local_shards([Shard(tensor, metadata)], *entry.full_shape,
                                  process_group=state.get_group(entry.group))
