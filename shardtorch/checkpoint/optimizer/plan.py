"""What each rank receives of a full optimizer state: the full state (a state
dict on one rank, or a checkpoint's description of one) checked against this
optimizer and the model, then one loop that builds this rank's state dict from
wherever the tensors come from (relocate, sharded files, DCP)."""
from typing import Callable, Dict, Optional

import torch

from ...distributed import state
from ..dtensor_entries import dtensor_spec, in_model_form
from ..layout import EntryLayout
from ..verify import strip_ddp_prefix
from .forms import StateDictFormError, flattened_hint, indexed
from .params import PARAM_KEYS, SPLIT_KINDS, OptimizerParams, class_name, is_zero, split_state_entry

#: State keys torch's optimizers keep per parameter: (always, only under some
#: hyperparameters). Used to name an optimizer of another class, or partial state.
STATE_KEYS = {
    "SGD": (lambda g: {"momentum_buffer"} if g.get("momentum", 0) else set(), {"momentum_buffer"}),
    "Adam": (lambda g: {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if g.get("amsgrad") else set()),
             {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "Adagrad": (lambda g: {"step", "sum"}, {"step", "sum"}),
    "RMSprop": (lambda g: {"step", "square_avg"} | ({"momentum_buffer"} if g.get("momentum", 0) else set())
                | ({"grad_avg"} if g.get("centered") else set()),
                {"step", "square_avg", "momentum_buffer", "grad_avg"}),
}
STATE_KEYS["AdamW"] = STATE_KEYS["Adam"]
# shardtorch.optim's row-sparse optimizers (a row_step per row where they need one).
STATE_KEYS["RowSparseSGD"] = (lambda g: {"momentum_buffer"} | ({"row_step"} if g.get("momentum", 0) and
                                                                 g.get("dampening", 0) else set()),
                              {"momentum_buffer", "row_step"})
STATE_KEYS["RowSparseAdam"] = (lambda g: {"exp_avg", "exp_avg_sq", "row_step"}, {"exp_avg", "exp_avg_sq", "row_step"})

_VARIANT_FLAGS = ("decoupled_weight_decay", "nesterov", "amsgrad", "centered")


def plan_from_full_state(params: OptimizerParams, optimizer, state_dict, strict: bool):
    """What every rank receives for each of this optimizer's parameters, or an
    error message naming what differs. ``state_dict``: the full state, keyed
    by integer ids (optimizer.state_dict(), collect_optimizer_state_dict) or by
    FQN (torch.distributed.checkpoint.state_dict's form).

    The plan: ``state`` {index: {key: ("value", v) | (kind, (dtype, full shape))}},
    ``param_groups`` (what ``load_state_dict`` takes) and ``saved_index``
    {index: the key of its state in ``indexed(state_dict)``}."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        return (f"src rank {state.get_rank()} must pass an optimizer state dict (a dict with 'state' and "
                f"'param_groups'), got {type(state_dict).__name__}"
                + (f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else "")
                + flattened_hint(state_dict))
    try:
        state_dict = indexed(state_dict)
    except StateDictFormError as e:
        return f"the optimizer state dict is malformed: {e}"
    saved_groups = state_dict["param_groups"]
    current = optimizer.param_groups
    cls = class_name(optimizer)
    if len(saved_groups) != len(current):
        return (f"the state has {len(saved_groups)} parameter group(s), this {cls} has {len(current)}")
    problems = []
    saved_index = {}   # this optimizer's index -> the state dict's index
    # ZeroRedundancyOptimizer's own groups gain the inner optimizer's defaults
    # only when it first syncs them; its inner optimizer has them from the start.
    inner = optimizer.optim.param_groups if is_zero(optimizer) else current
    if len(inner) != len(current):
        inner = current
    for g, (saved, group, indices) in enumerate(zip(saved_groups, current, params.groups)):
        saved_keys = {k for k in saved if k not in PARAM_KEYS}
        keys = {k for k in group if k not in PARAM_KEYS} | {k for k in inner[g] if k not in PARAM_KEYS}
        if saved_keys != keys:
            problems.append(f"group {g} has hyperparameters {sorted(saved_keys)} in the state but this {cls} has "
                            f"{sorted(keys)} (missing {sorted(keys - saved_keys)}, unexpected "
                            f"{sorted(saved_keys - keys)}): the state is of another optimizer class")
            continue
        merged = {**inner[g], **group}
        flags = [k for k in _VARIANT_FLAGS if k in keys and bool(saved[k]) != bool(merged[k])]
        if flags:
            problems.append(f"group {g}: {', '.join(f'{k}={saved[k]!r} in the state, {merged[k]!r} here' for k in flags)}"
                            f" (the state is of another optimizer variant)")
        names = [params.names[i] for i in indices]
        saved_params = list(saved["params"])
        if "param_names" in saved:
            saved_names = [strip_ddp_prefix(n) for n in saved["param_names"]]
            missing = [n for n in names if n not in saved_names]
            unexpected = [n for n in saved_names if n not in names]
            if missing or unexpected:
                problems.append(f"group {g}: " + "; ".join(
                    [f"missing parameter {n!r}" for n in missing] +
                    [f"unexpected parameter {n!r} that this optimizer does not hold" for n in unexpected]))
                continue
            where = dict(zip(saved_names, saved_params))
            for i in indices:
                saved_index[i] = where[params.names[i]]
        else:
            if len(saved_params) != len(indices):
                problems.append(f"group {g} has {len(saved_params)} parameters in the state but {len(indices)} "
                                f"here ({', '.join(repr(n) for n in names)}); a parameter is missing or extra")
                continue
            saved_index.update(zip(indices, saved_params))
    if problems:
        return "the optimizer state does not fit this optimizer: " + "; ".join(problems)

    listed = set(saved_index.values())
    strays = [k for k in state_dict["state"] if k not in listed]
    if strays:
        problems.append(f"state for index(es) {strays} that no parameter group lists")
    plan_state: Dict[int, dict] = {}
    for g, (saved, indices) in enumerate(zip(saved_groups, params.groups)):
        with_state = [i for i in indices if saved_index[i] in state_dict["state"]]
        for i in indices:
            values = state_dict["state"].get(saved_index[i])
            if values is None:
                if strict and with_state and params.params[i].requires_grad:
                    problems.append(f"parameter {params.names[i]!r} has no state while {len(with_state)} other(s) "
                                    f"of group {g} have some (partial optimizer state; strict=False accepts it)")
                continue
            plan = _plan_parameter(params, i, values, saved, cls, problems)
            if plan is not None:
                plan_state[i] = plan
    if problems:
        return "the optimizer state does not fit this optimizer: " + "; ".join(problems)
    groups = params.named_groups(saved_groups, with_indices=True)
    return {"state": plan_state, "param_groups": groups, "saved_index": saved_index}


def _plan_parameter(params: OptimizerParams, i: int, values: dict, saved_group: dict, cls: str,
                    problems: list) -> Optional[dict]:
    """One parameter's plan, or None after appending what is wrong to ``problems``."""
    name, entry = params.names[i], params.entry(i)
    expected_keys = STATE_KEYS.get(cls)
    if expected_keys is not None:
        required, allowed = expected_keys[0](saved_group), expected_keys[1]
        keys = {str(k) for k in values}
        if keys - allowed or required - keys:
            problems.append(f"parameter {name!r} has state {sorted(keys)}, {cls} keeps {sorted(required)}"
                            + (f" (missing {sorted(required - keys)})" if required - keys else "")
                            + (f" (unexpected {sorted(keys - allowed)})" if keys - allowed else ""))
            return None
    plan = {}
    for key, value in values.items():
        if not torch.is_tensor(value) or value.dim() == 0:
            plan[key] = ("value", value)
        elif tuple(value.shape) == tuple(entry.full_shape):
            plan[key] = ("sharded" if entry.sharded else "replicated", (value.dtype, tuple(value.shape)))
        elif entry.sharded and str(key) in params.row_keys and tuple(value.shape) == tuple(entry.full_shape[:1]):
            plan[key] = ("rows" if entry.dim == 0 else "replicated", (value.dtype, tuple(value.shape)))
        elif entry.sharded:
            rows = f", one value per row ({entry.full_shape[0]})," if str(key) in params.row_keys else ""
            problems.append(f"parameter {name!r} state {key!r} has shape {tuple(value.shape)}, neither the "
                            f"parameter's full shape {tuple(entry.full_shape)}{rows} nor a scalar")
            return None
        else:
            plan[key] = ("replicated", (value.dtype, tuple(value.shape)))
    return plan


def load_state(params: OptimizerParams, plan: dict,
               load_tensor: Callable[[EntryLayout, int, object], torch.Tensor]) -> dict:
    """This rank's optimizer state dict (what ``optimizer.load_state_dict``
    takes) from a plan: plain values from the plan, and each tensor from
    ``load_tensor(entry, index, key)``, where ``entry`` says where it lands on
    this rank (sharded like its parameter, or whole) and ``entry.key`` names
    it in the checkpoint (``plan["entry_keys"]``, when the plan has them)."""
    entry_keys = plan.get("entry_keys", {})
    result: Dict[int, dict] = {}
    for index, keys in plan["state"].items():
        out = {}
        for key, (kind, info) in keys.items():
            if kind == "value":
                # A copy: the optimizer steps its "step" tensor in place, and
                # this one may be the caller's (a collected state in the same
                # process, still the live state of the optimizer it came from).
                out[key] = info.clone() if torch.is_tensor(info) else info
                continue
            dtype, shape = info
            entry_key = entry_keys.get(index, {}).get(key, f"{params.names[index]}/{key}")
            entry = params.entry(index)
            if kind in SPLIT_KINDS:
                entry = split_state_entry(entry, kind, entry_key, dtype, entry.device)
            else:
                entry = EntryLayout(entry_key, shape, shape, dtype, entry.device)
            out[key] = load_tensor(entry, index, key)
        result[index] = out
    return {"state": result, "param_groups": plan["param_groups"]}


def in_model_forms(params: OptimizerParams, loaded: dict) -> dict:
    """``loaded`` (load_state's result, filled) with each state tensor shaped
    like a parameter that fully_shard made a DTensor cut into a DTensor like
    it, as the optimizer's own state is under fully_shard (in place)."""
    for index, values in loaded["state"].items():
        spec = dtensor_spec(params.params[index])
        if spec is None:
            continue
        for key, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == tuple(params.params[index].shape):
                values[key] = in_model_form(value, spec)
    return loaded
