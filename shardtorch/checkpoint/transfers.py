"""Moving one state-dict entry between its shards and its whole form: what
collect_state_dict / relocate_state_dict and their optimizer-state versions
share. Each function is a collective over the entry's group (or the world):
every rank calls it for the same entries in the same order."""
from typing import Optional

import torch

from ..distributed import collectives, state
from .layout import EntryLayout


def gather_everywhere(tensor: torch.Tensor, entry: EntryLayout) -> torch.Tensor:
    """Every member of the group receives the full tensor, each shard broadcast
    by its holder straight into its place (rows) or through one shard-sized
    buffer (columns, or a head-aligned split's several pieces). Unlike the
    core's all-gather, which pads shards to equal size and concatenates,
    nothing beyond the result and one shard is held."""
    members = state.get_group_ranks(entry.group)
    if len(members) == 1:
        return tensor
    process_group = state.get_group(entry.group)
    rank = state.get_rank()
    full = torch.empty(entry.full_shape, dtype=tensor.dtype, device=tensor.device)
    for group_rank, peer in enumerate(members):
        shape = entry.shard_shape(group_rank)
        if shape[entry.dim] == 0:
            continue
        in_place = entry.dim == 0 and entry.contiguous
        if in_place:
            offset, length = entry.slice_of(group_rank)
            buffer = full.narrow(0, offset, length)
            if peer == rank:
                buffer.copy_(tensor)
        else:
            buffer = tensor.detach().contiguous() if peer == rank else torch.empty(
                shape, dtype=tensor.dtype, device=tensor.device)
        collectives.broadcast(buffer, peer, group=process_group)
        if not in_place:
            entry.place(full, buffer, group_rank)
    return full


def gather_to(tensor: torch.Tensor, entry: EntryLayout, dst: int) -> Optional[torch.Tensor]:
    """Point-to-point gather of one entry to global rank ``dst`` (None elsewhere)."""
    members = state.get_group_ranks(entry.group)
    if dst not in members:
        return None  # another tensor-parallel group serves dst
    rank = state.get_rank()
    if rank != dst:
        if tensor.numel() > 0:  # an empty shard has nothing to send
            collectives.send(tensor.detach().contiguous(), dst)
        return None
    full = torch.empty(entry.full_shape, dtype=tensor.dtype, device=tensor.device)
    for group_rank, peer in enumerate(members):
        shape = entry.shard_shape(group_rank)
        if peer == rank:
            entry.place(full, tensor, group_rank)
        elif shape[entry.dim] == 0:
            continue
        elif entry.dim == 0 and entry.contiguous:
            offset, length = entry.slice_of(group_rank)
            collectives.recv(full.narrow(0, offset, length), peer)  # rows of a contiguous tensor: receive in place
        else:
            buffer = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
            collectives.recv(buffer, peer)
            entry.place(full, buffer, group_rank)
    return full


def scatter_slices(full: Optional[torch.Tensor], entry: EntryLayout, dtype: torch.dtype,
                   src: int) -> torch.Tensor:
    """Every rank receives its slice of ``full`` from ``src``: each slice is
    made contiguous once and sent to the ranks of every tensor-parallel group
    that hold it, so ``src`` holds at most one slice beyond the checkpoint."""
    rank = state.get_rank()
    device = entry.device
    if rank == src:
        mine = None
        for group_rank, ranks in enumerate(_holders_by_group_rank(entry.group)):
            piece = entry.take(full, group_rank).to(device).contiguous()
            for peer in ranks:
                if peer == rank:
                    # Own a copy rather than a view that would keep the whole
                    # checkpoint tensor alive as long as the result.
                    shares = piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
                    mine = piece.clone() if shares else piece
                elif piece.numel() > 0:
                    collectives.send(piece, peer)
            del piece
        return mine
    buffer = torch.empty(entry.local_shape, dtype=dtype, device=device)
    if buffer.numel() > 0:
        collectives.recv(buffer, src)
    return buffer


def broadcast_whole(full: Optional[torch.Tensor], entry: EntryLayout, dtype: torch.dtype,
                    src: int) -> torch.Tensor:
    """Every rank receives the whole of a replicated entry from ``src``."""
    rank = state.get_rank()
    if rank == src:
        tensor = full.to(entry.device).contiguous()
    else:
        tensor = torch.empty(entry.full_shape, dtype=dtype, device=entry.device)
    if state.get_world_size() > 1 and tensor.numel() > 0:
        collectives.broadcast(tensor, src)
    return tensor


def _holders_by_group_rank(group: str):
    """Global ranks that hold group rank r of ``group``, for r = 0, 1, ...: the
    r-th member of every group of that kind (every tensor-parallel group, or
    the one world group)."""
    if group == state.WORLD:
        return [[r] for r in range(state.get_world_size())]
    if group != state.TENSOR_PARALLEL:
        raise NotImplementedError(f"relocate_state_dict: entries sharded over group {group!r} are not "
                                  f"supported; only {state.TENSOR_PARALLEL!r} and {state.WORLD!r}")
    groups = state._require("relocate_state_dict").topology.tensor_parallel_groups()
    return [[members[r] for members in groups] for r in range(state.get_group_size(group))]
