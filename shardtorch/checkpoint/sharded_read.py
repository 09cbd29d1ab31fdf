"""Reads this rank's slice of one entry of a sharded checkpoint.

Each rank opens only the files whose slices overlap its own, through torch's
memory-mapped loading, so only the pages of the bytes it copies are read.
Serves the model's entries (sharded_load.py) and the optimizer's
(optimizer/sharded.py) alike.
"""
import os
from typing import Dict

import torch

from . import sharded_format as fmt
from .layout import EntryLayout


def read_box(entry: EntryLayout, saved: dict, directory: str, files: Dict[str, dict]) -> torch.Tensor:
    """This rank's shard: its box of the full tensor, or for a head-aligned or fused split
    (ts.nn.parallelize) its boxes in the order the shard stores them, each copied from every saved shard
    that overlaps it."""
    if not entry.sharded or entry.contiguous:
        want_offsets = [0] * len(entry.full_shape)
        if entry.sharded:
            want_offsets[entry.dim] = entry.slice_of(entry.group_rank)[0]
        return _read_one_box(entry, saved, directory, files, want_offsets, list(entry.local_shape))
    boxes = []
    for offset, length in entry.pieces_of(entry.group_rank):
        want_offsets, want_shape = [0] * len(entry.full_shape), list(entry.local_shape)
        want_offsets[entry.dim], want_shape[entry.dim] = offset, length
        boxes.append(_read_one_box(entry, saved, directory, files, want_offsets, want_shape))
    return boxes[0] if len(boxes) == 1 else torch.cat(boxes, entry.dim)


def _read_one_box(entry: EntryLayout, saved: dict, directory: str, files: Dict[str, dict], want_offsets,
                  want_shape) -> torch.Tensor:
    out = torch.empty(want_shape, dtype=entry.dtype, device=entry.device)  # copy_ casts a saved dtype
    if out.numel() == 0:
        return out
    covered = 0
    for shard in saved["shards"]:
        lows = [max(a, b) for a, b in zip(want_offsets, shard["offsets"])]
        highs = [min(a + n, b + m) for a, n, b, m in zip(want_offsets, want_shape, shard["offsets"],
                                                         shard["shape"])]
        if any(lo >= hi for lo, hi in zip(lows, highs)):
            continue  # this file holds none of the slice: not even opened
        contents = _open(directory, shard["file"], files)
        source = contents[shard["name"] if "name" in shard else _saved_key(entry.key, contents)]
        src_view, dst_view = source, out
        for d, (lo, hi) in enumerate(zip(lows, highs)):
            length = max(hi - lo, 0)
            src_view = src_view.narrow(d, lo - shard["offsets"][d], length)
            dst_view = dst_view.narrow(d, lo - want_offsets[d], length)
        dst_view.copy_(src_view)
        covered += dst_view.numel()
    if covered != out.numel():
        raise fmt.CheckpointFormatError(
            f"load_sharded: the saved shards of {entry.key!r} cover {covered} of the {out.numel()} "
            f"elements this rank needs (box at {want_offsets}): the index in {directory} is inconsistent")
    return out


def _saved_key(key: str, contents: dict) -> str:
    """The key as the file spells it (with or without DDP's "module." prefix)."""
    for candidate in (key, f"module.{key}", key[len("module."):]):
        if candidate in contents:
            return candidate
    raise fmt.CheckpointFormatError(f"load_sharded: entry {key!r} is missing from its shard file")


def _open(directory: str, name: str, files: Dict[str, dict]) -> dict:
    if name not in files:
        path = os.path.join(directory, name)
        try:
            files[name] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - name the file whatever went wrong
            raise fmt.CheckpointFormatError(f"load_sharded: cannot read shard file {path}: "
                                            f"{type(e).__name__}: {e}") from None
    return files[name]
