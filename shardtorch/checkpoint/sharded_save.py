"""save_sharded: every rank writes its own shards; no rank ever holds more
than its own shards (for models too big to gather on one rank)."""
import os
import shutil
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..distributed import collectives, state
from . import sharded_format as fmt
from .dtensor_entries import whole_shard
from .layout import EntryLayout, model_layout
from .optimizer.sharded import OPTIMIZER_META_KEY, sharded_optimizer_entries


class SaveFailedError(RuntimeError):
    """A rank could not write its part; the save was not committed."""


def save_sharded(model: torch.nn.Module, path: str, state_dict: Optional[dict] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> str:
    """Writes a sharded checkpoint of ``model`` (or of ``state_dict``, one of
    its state dicts) under the directory ``path``; returns the version written.
    With ``optimizer`` (a torch optimizer over the model's parameters), its
    state goes in the same version, each state tensor laid out like its
    parameter, so that load_sharded(model, path, optimizer=...) restores it
    at any size; the save commits both or neither.

    Collective: every rank of the world calls it with the same ``path`` on a
    file system all ranks share. The ranks of the first tensor-parallel group
    write one file each with their shards; global rank 0 also writes the
    replicated entries (data-parallel replicas hold the same values and write
    nothing). The save commits (rank 0 writes the index, then ``LATEST``) only
    after every rank has reported its file complete, so a failure anywhere,
    reported or a crash, leaves the previous checkpoint at ``path`` the one
    that loads. A rank that fails makes every rank raise SaveFailedError. Older
    versions are removed once the new one is committed. Under fully_shard
    (FSDP2) every entry is gathered over its data-parallel mesh first (one
    at a time), so a writer holds its whole shards, as without fully_shard.
    """
    state_dict = model.state_dict() if state_dict is None else state_dict
    layout = model_layout(model, state_dict)
    optimizer_meta, optimizer_keys = None, ()
    if optimizer is not None:
        tensors, optimizer_layout, optimizer_meta = sharded_optimizer_entries(model, optimizer, layout)
        optimizer_keys = list(optimizer_layout)
        state_dict = {**state_dict, **tensors}
        layout = {**layout, **optimizer_layout}
    rank = state.get_rank()
    version = _agree_on_version()
    directory = os.path.join(path, version)
    file_name = fmt.rank_file_name(rank)
    report = {"rank": rank, "error": None, "file": None, "records": []}
    try:
        os.makedirs(directory, exist_ok=True)
        mine, report["records"] = _entries_this_rank_writes(state_dict, layout, file_name)
        if optimizer_meta is not None and rank == 0:
            mine[OPTIMIZER_META_KEY] = optimizer_meta  # groups, names and scalar state (step)
        if mine:
            fmt.write_atomically(os.path.join(directory, file_name), lambda f: torch.save(mine, f))
            report["file"] = {"name": file_name,
                              "bytes": os.path.getsize(os.path.join(directory, file_name))}
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised
        report["error"] = f"{type(e).__name__}: {e}"
    reports = _all_gather_objects(report)
    failures = [r for r in reports if r["error"]]
    if failures:
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        raise SaveFailedError("save_sharded: not committed, the previous checkpoint at "
                              f"{path!r} is unchanged; " +
                              "; ".join(f"rank {r['rank']} failed: {r['error']}" for r in failures))
    commit_error = None
    if rank == 0:
        try:
            _commit(path, directory, version, _index(layout, reports, optimizer_keys,
                                                    optimizer_meta is not None))
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            commit_error = f"save_sharded: committing {directory} failed: {type(e).__name__}: {e}"
    box = [commit_error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.broadcast_object_list(box, src=0)
    if box[0]:
        raise SaveFailedError(box[0])
    return version


def _agree_on_version() -> str:
    box = [fmt.new_version_name()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather_objects(value) -> List:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    values = [None] * dist.get_world_size()
    collectives.all_gather_object(values, value)
    return values


def _writes_shards() -> bool:
    """Ranks of the first tensor-parallel group write the sharded entries."""
    groups = state._require("save_sharded").topology.tensor_parallel_groups()
    return state.get_rank() in groups[0]


def _entries_this_rank_writes(state_dict, layout: Dict[str, EntryLayout], file_name: str):
    mine, records = {}, []
    writes_shards = _writes_shards()
    for key, tensor in state_dict.items():
        entry = layout[key]
        tensor = whole_shard(tensor)  # under fully_shard: collective over its mesh, on every rank
        if entry.sharded and entry.group not in (state.TENSOR_PARALLEL, state.WORLD):
            raise NotImplementedError(f"save_sharded: entry {key!r} is sharded over group "
                                      f"{entry.group!r}; only 'tp' and 'world' are supported")
        if entry.sharded and (writes_shards or entry.group == state.WORLD):
            if not entry.contiguous:  # split by whole heads: one record per piece of the full tensor
                _write_pieces(key, tensor.detach(), entry, file_name, mine, records)
                continue
            offsets = [0] * len(entry.full_shape)
            offsets[entry.dim] = entry.slice_of(entry.group_rank)[0]
        elif not entry.sharded and state.get_rank() == 0:
            offsets = [0] * len(entry.full_shape)
        else:
            continue
        mine[key] = _own_bytes(tensor.detach())
        records.append({"key": key, "file": file_name, "offsets": offsets,
                        "shape": list(tensor.shape)})
    return mine, records


def _own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()  # torch.save writes whole storages: keep only the shard's bytes
    return tensor


def _write_pieces(key: str, shard: torch.Tensor, entry: EntryLayout, file_name: str, mine: dict,
                  records: list) -> None:
    """A head-aligned or fused shard (several slices of the full tensor, ts.nn.parallelize) saved as one
    tensor per slice, each under its own name in the file ("name" in its record), so that the index keeps
    describing plain boxes of the full tensor and a load at any group size reads them as any other."""
    start = 0
    for number, (offset, length) in enumerate(entry.pieces_of(entry.group_rank)):
        piece = shard.narrow(entry.dim, start, length)
        start += length
        name = f"{key}#piece{number}"
        mine[name] = piece.contiguous().clone()
        offsets = [0] * len(entry.full_shape)
        offsets[entry.dim] = offset
        records.append({"key": key, "file": file_name, "offsets": offsets, "shape": list(piece.shape),
                        "name": name})


def _index(layout: Dict[str, EntryLayout], reports, optimizer_keys=(), with_optimizer=False) -> dict:
    entries = {key: {"shape": list(e.full_shape), "dtype": str(e.dtype).replace("torch.", ""),
                     "dim": e.dim, "group_size": e.group_size, "shards": []}
               for key, e in layout.items()}
    files = {}
    for report in reports:
        if report["file"]:
            files[report["file"]["name"]] = {"bytes": report["file"]["bytes"], "rank": report["rank"]}
        for record in report["records"]:
            entries[record["key"]]["shards"].append(
                {field: record[field] for field in ("file", "offsets", "shape", "name") if field in record})
    index = {"format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION,
             "tensor_parallel_size": state.get_group_size(state.TENSOR_PARALLEL),
             "world_size": state.get_world_size(), "files": files, "entries": entries}
    if with_optimizer:
        # Apart from the model's entries, so that a model-only load sees exactly the model.
        index["optimizer"] = {"file": fmt.rank_file_name(0), "key": OPTIMIZER_META_KEY,
                              "entries": {k: entries.pop(k) for k in optimizer_keys}}
    return index


def _commit(path: str, directory: str, version: str, index: dict) -> None:
    fmt.write_json_atomically(os.path.join(directory, fmt.INDEX), index)
    # The commit point: from here on, loads read the new version.
    fmt.write_atomically(os.path.join(path, fmt.LATEST), lambda f: f.write(version.encode()))
    for name in os.listdir(path):
        if name.startswith(fmt.VERSION_PREFIX) and name != version:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
