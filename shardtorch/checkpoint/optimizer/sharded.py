"""Optimizer state in sharded checkpoints (save_sharded / load_sharded with
``optimizer=``): entries beside the model's in the rank files, the meta object
in rank 0's file, listed apart under "optimizer" in index.json."""
import os
from typing import Dict

import torch

from .. import sharded_format as fmt
from ..layout import EntryLayout
from ..sharded_read import read_box
from .checks import checked_params, plan_on_one_rank
from .entries import optimizer_entries, plan_from_meta
from .plan import in_model_forms, load_state

OPTIMIZER_META_KEY = "__optimizer__"


def sharded_optimizer_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              layout: Dict[str, EntryLayout]):
    """What save_sharded writes of the optimizer on this rank (see
    entries.optimizer_entries); global rank 0 writes the meta. Collective."""
    return optimizer_entries(model, optimizer, layout, "save_sharded")


def load_sharded_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                      path: str, strict: bool = True) -> dict:
    """This rank's optimizer state dict (for ``optimizer.load_state_dict``)
    from a sharded checkpoint that save_sharded wrote with ``optimizer=``, at
    any tensor-parallel and data-parallel size. Collective; rank 0 checks the
    checkpoint and the state against this optimizer (as
    relocate_optimizer_state_dict does) and every rank raises on a mismatch."""
    what = "load_sharded"
    params = checked_params(model, optimizer, what)

    def make_plan():
        directory = fmt.committed_version(path)
        index = fmt.read_index(directory)
        fmt.check_files(directory, index)
        if "optimizer" not in index:
            raise fmt.CheckpointFormatError(
                f"{directory} holds no optimizer state (saved without save_sharded(..., optimizer=...))")
        section = index["optimizer"]
        contents = torch.load(os.path.join(directory, section["file"]), map_location="cpu", mmap=True,
                              weights_only=True)
        plan = plan_from_meta(params, optimizer, contents[section["key"]], section["entries"], strict)
        if not isinstance(plan, str):
            plan["directory"] = directory
            plan["entries"] = {ek: section["entries"][ek] for keys in plan["entry_keys"].values()
                               for ek in keys.values()}
        return plan

    plan = plan_on_one_rank(0, make_plan, f"{what}: optimizer state",
                            lambda e: str(e).replace("load_sharded: ", "", 1))
    files: Dict[str, dict] = {}
    return in_model_forms(params, load_state(params, plan, lambda entry, index, key: read_box(
        entry, plan["entries"][entry.key], plan["directory"], files)))
