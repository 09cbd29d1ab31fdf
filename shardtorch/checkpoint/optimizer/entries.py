"""The optimizer state as checkpoint entries and back, for both checkpoint
formats (sharded files and DCP): each state tensor an entry
``optimizer/<parameter name>/<key>`` laid out like its parameter (sharded or
replicated), and one meta object with the optimizer class, the groups, the
names and the scalar state (step), from which a loader plans as relocate does."""
from typing import Dict

import torch

from ..layout import EntryLayout
from .checks import check_optimizer_kind
from .local import local_and_agreed, tensor_parallel_group_of
from .params import SPLIT_KINDS, OptimizerParams, class_name, split_state_entry
from .plan import plan_from_full_state


def entry_key(name: str, key) -> str:
    return f"optimizer/{name}/{key}"


def optimizer_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      layout: Dict[str, EntryLayout], what: str, every_rank: bool = False):
    """This rank's optimizer state as extra checkpoint entries:
    ({entry key: tensor}, {entry key: EntryLayout}, meta), meta None on ranks
    that hold no state to write. Collective: the ranks' optimizers are
    compared first, as collect_optimizer_state_dict does. The ranks of the
    first tensor-parallel group hold the state (a ZeroRedundancyOptimizer's is
    consolidated there), unless ``every_rank`` (DCP: every rank takes part)."""
    check_optimizer_kind(optimizer, what)
    params = OptimizerParams(model, optimizer)
    params.read_layout(model, layout)
    local, description = local_and_agreed(optimizer, params, None if every_rank else tensor_parallel_group_of(0),
                                          what)
    tensors, layouts, values, tensor_keys = {}, {}, {}, {}
    if local is None:
        return tensors, layouts, None
    for index, state_values in local["state"].items():
        name = params.names[index]
        kinds = description["state"][name]
        for key, value in state_values.items():
            kind = kinds[str(key)][0]
            if kind == "value":
                values.setdefault(name, []).append((key, value))
                continue
            ek = entry_key(name, key)
            if kind in SPLIT_KINDS:
                layouts[ek] = split_state_entry(params.entry(index), kind, ek, value.dtype, value.device)
            else:
                shape = tuple(value.shape)
                layouts[ek] = EntryLayout(ek, shape, shape, value.dtype, value.device)
            tensors[ek] = value
            tensor_keys.setdefault(name, []).append((key, ek))
        values.setdefault(name, [])
    meta = {"optimizer": class_name(optimizer),
            "param_groups": params.named_groups(local["param_groups"], with_indices=False),
            "values": values, "tensors": tensor_keys,
            "shapes": {ek: {"shape": list(e.full_shape), "dtype": str(e.dtype).replace("torch.", "")}
                       for ek, e in layouts.items()}}
    return tensors, layouts, meta


def _skeleton(meta: dict, shapes: dict) -> dict:
    """A full optimizer state dict of meta tensors (shapes and dtypes only),
    keyed by position in the saved groups, for plan_from_full_state's checks."""
    state_dict = {"state": {}, "param_groups": []}
    position = {}
    for group in meta["param_groups"]:
        group = dict(group)
        group["params"] = []
        for name in group["param_names"]:
            position[name] = len(position)
            group["params"].append(position[name])
        state_dict["param_groups"].append(group)
    for name, pairs in meta["values"].items():
        values = dict(pairs)
        for key, ek in meta["tensors"].get(name, []):
            entry = shapes[ek]
            values[key] = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]), device="meta")
        state_dict["state"][position[name]] = values
    return state_dict


def plan_from_meta(params: OptimizerParams, optimizer, meta: dict, shapes: dict, strict: bool):
    """plan_from_full_state for a checkpoint's meta (``shapes``: {entry key:
    {"shape", "dtype"}}), plus each state tensor's entry key; or a message."""
    if meta["optimizer"] != class_name(optimizer):
        return f"the checkpoint holds {meta['optimizer']} state, this optimizer is a {class_name(optimizer)}"
    skeleton = _skeleton(meta, shapes)
    plan = plan_from_full_state(params, optimizer, skeleton, strict)
    if not isinstance(plan, str):
        names = {i: n for g in skeleton["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        plan["entry_keys"] = {i: dict(meta["tensors"].get(names[plan["saved_index"][i]], []))
                              for i in plan["state"]}
    return plan
