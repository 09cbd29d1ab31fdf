"""load_sharded: reads a sharded checkpoint into a model of any group size.

Each rank reads only the files whose slices overlap its own, through torch's
memory-mapped loading, so only the pages of the bytes it copies are read.
"""
import os
from collections import OrderedDict
from typing import Dict, Optional

import torch

from ..distributed import state
from . import sharded_format as fmt
from .layout import EntryLayout, model_layout
from .verify import broadcast_verdict, match_ddp_prefix, mismatches


def load_sharded_state_dict(model: torch.nn.Module, path: str) -> "OrderedDict[str, torch.Tensor]":
    """This rank's state dict for ``model`` from the sharded checkpoint at
    ``path`` (the directory save_sharded wrote, or one version directory in it),
    whatever group size it was saved with.

    Collective: every rank calls it. Rank 0 first checks that the checkpoint is
    committed and complete (every file present with its size) and that its
    keys and full shapes fit the model, then broadcasts the verdict: any
    problem raises on every rank, naming the file or key.
    """
    layout = model_layout(model)
    verdict = _check_on_rank0(path, layout) if state.get_rank() == 0 else None
    directory = broadcast_verdict(verdict, 0, "load_sharded")["directory"]
    index = fmt.read_index(directory)
    saved = match_ddp_prefix(index["entries"], list(layout))
    files: Dict[str, dict] = {}
    result = OrderedDict()
    for key, entry in layout.items():
        result[key] = _assemble(entry, saved[key], directory, files)
    return result


def load_sharded(model: torch.nn.Module, path: str, strict: bool = True,
                 optimizer: Optional[torch.optim.Optimizer] = None):
    """Loads the sharded checkpoint at ``path`` into ``model`` (see
    load_sharded_state_dict) and, given ``optimizer``, its optimizer state
    (saved with save_sharded(..., optimizer=...), at any size; see
    load_sharded_optimizer_state_dict); returns what ``model.load_state_dict``
    returns. Everything is read and checked before anything is loaded."""
    model_state = load_sharded_state_dict(model, path)
    optimizer_state = None
    if optimizer is not None:
        from .optimizer import load_sharded_optimizer_state_dict
        optimizer_state = load_sharded_optimizer_state_dict(model, optimizer, path, strict=strict)
    result = model.load_state_dict(model_state, strict=strict)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    return result


def _check_on_rank0(path: str, layout: Dict[str, EntryLayout]):
    try:
        directory = fmt.committed_version(path)
        index = fmt.read_index(directory)
        fmt.check_files(directory, index)
    except fmt.CheckpointFormatError as e:
        return str(e).replace("load_sharded: ", "", 1)
    saved = match_ddp_prefix(index["entries"], list(layout))
    problems = mismatches({k: tuple(v["shape"]) for k, v in saved.items()}, layout)
    if problems:
        return f"the checkpoint at {directory} does not fit the model: " + "; ".join(problems)
    return {"directory": directory}


def _assemble(entry: EntryLayout, saved: dict, directory: str, files: Dict[str, dict]) -> torch.Tensor:
    """This rank's box of the full tensor, copied from every saved shard that overlaps it."""
    want_offsets = [0] * len(entry.full_shape)
    if entry.sharded:
        want_offsets[entry.dim] = entry.slice_of(entry.group_rank)[0]
    want_shape = list(entry.local_shape)
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
        source = contents[_saved_key(entry.key, contents)]
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
            f"elements this rank needs: the index in {directory} is inconsistent")
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
