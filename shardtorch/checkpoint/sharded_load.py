"""load_sharded: reads a sharded checkpoint into a model of any group size
(each rank reads only the files that hold part of its slices: sharded_read.py)."""
from collections import OrderedDict
from typing import Dict, Optional

import torch

from ..distributed import state
from . import sharded_format as fmt
from .dtensor_entries import in_model_form
from .layout import EntryLayout, model_layout
from .optimizer.sharded import load_sharded_optimizer_state_dict
from .sharded_read import read_box
from .verify import broadcast_verdict, match_ddp_prefix, mismatches


def load_sharded_state_dict(model: torch.nn.Module, path: str) -> "OrderedDict[str, torch.Tensor]":
    """This rank's state dict for ``model`` from the sharded checkpoint at
    ``path`` (the directory save_sharded wrote, or one version directory in it),
    whatever group size it was saved with.

    Collective: every rank calls it. Rank 0 first checks that the checkpoint is
    committed and complete (every file present with its size) and that its
    keys and full shapes fit the model, then broadcasts the verdict: any
    problem raises on every rank, naming the file or key. Under fully_shard
    (FSDP2) each entry the model holds as a DTensor is returned as one.
    """
    layout = model_layout(model)
    verdict = _check_on_rank0(path, layout) if state.get_rank() == 0 else None
    directory = broadcast_verdict(verdict, 0, "load_sharded")["directory"]
    index = fmt.read_index(directory)
    saved = match_ddp_prefix(index["entries"], list(layout))
    files: Dict[str, dict] = {}
    result = OrderedDict()
    for key, entry in layout.items():
        result[key] = in_model_form(read_box(entry, saved[key], directory, files), entry.fsdp)
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
