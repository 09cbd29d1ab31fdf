"""Optimizer state that follows the shards.

collect_optimizer_state_dict / relocate_optimizer_state_dict are the optimizer
twins of collect_state_dict / relocate_state_dict. The collected form is what
the same optimizer over the unsharded model holds: ``optimizer.state_dict()``'s
``{"state": {index: {...}}, "param_groups": [...]}``, every per-parameter
tensor shaped like the full parameter, plus torch's own ``param_names`` in each
group (the unsharded model's parameter names), so a plain single-process torch
program loads it with ``torch.optim.X(model.parameters()).load_state_dict``.

Which state is sharded follows from the parameter's layout (layout.py, read
from the layer that owns it): a state tensor shaped like a sharded parameter's
shard is sharded like it; a 0-d tensor (``step``) or a non-tensor is kept as
one value; any other tensor of a sharded parameter cannot be classified and
raises. State of replicated parameters is taken from one replica (checked
identical across ranks under SHARDTORCH_DEBUG=1).
"""
import dataclasses
import hashlib
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed import state
from .collect import _gather_everywhere, _gather_to
from .layout import EntryLayout, model_layout
from .relocate import _broadcast, _scatter_slices
from .verify import CheckpointMismatchError

DDP_PREFIX = "module."

#: State keys torch's optimizers keep per parameter: (always, only under some
#: hyperparameters). Used to name an optimizer of another class, or partial state.
_STATE_KEYS = {
    "SGD": (lambda g: {"momentum_buffer"} if g.get("momentum", 0) else set(), {"momentum_buffer"}),
    "Adam": (lambda g: {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if g.get("amsgrad") else set()),
             {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "Adagrad": (lambda g: {"step", "sum"}, {"step", "sum"}),
    "RMSprop": (lambda g: {"step", "square_avg"} | ({"momentum_buffer"} if g.get("momentum", 0) else set())
                | ({"grad_avg"} if g.get("centered") else set()),
                {"step", "square_avg", "momentum_buffer", "grad_avg"}),
}
_STATE_KEYS["AdamW"] = _STATE_KEYS["Adam"]


class OptimizerStateMismatchError(CheckpointMismatchError):
    """The optimizer state does not fit the optimizer or the model."""


def _debug() -> bool:
    return os.environ.get("SHARDTORCH_DEBUG", "0") not in ("", "0")


def _plain(name: str) -> str:
    while name.startswith(DDP_PREFIX):
        name = name[len(DDP_PREFIX):]
    return name


def _is_zero(optimizer) -> bool:
    return hasattr(optimizer, "consolidate_state_dict") and hasattr(optimizer, "optim")


def _class_name(optimizer) -> str:
    """The optimizer that keeps the state (ZeroRedundancyOptimizer's inner one)."""
    return type(optimizer.optim).__name__ if _is_zero(optimizer) else type(optimizer).__name__


def _check_optimizer_kind(optimizer, what: str) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if _is_zero(optimizer):
        zero_ranks = dist.get_process_group_ranks(optimizer.process_group)
        dp_ranks = state.get_group_ranks(state.DATA_PARALLEL)
        if sorted(zero_ranks) != sorted(dp_ranks):
            # Over other ranks, one parameter index would stand for different shards.
            raise NotImplementedError(
                f"{what}: a ZeroRedundancyOptimizer must run over the data-parallel group "
                f"(ranks {dp_ranks} for rank {state.get_rank()}), this one runs over ranks {zero_ranks}")


def _local_state(optimizer, receivers: Optional[List[int]]) -> Optional[dict]:
    """This rank's optimizer.state_dict(), or None on ranks that take no part.

    A ZeroRedundancyOptimizer's state is spread over its data-parallel group:
    it is consolidated (collective over every data-parallel group) on the
    members of ``receivers`` (global ranks, one tensor-parallel group: each
    data-parallel group holds one of them), or on every rank when None; ranks
    not consolidated to return None."""
    if not _is_zero(optimizer):
        return optimizer.state_dict()
    members = dist.get_process_group_ranks(optimizer.process_group)
    targets = range(len(members)) if receivers is None else \
        [i for i, r in enumerate(members) if r in receivers]
    mine = None
    for target in targets:
        optimizer.consolidate_state_dict(to=target)
        if members[target] == state.get_rank():
            mine = optimizer.state_dict()
        optimizer._all_state_dicts = []  # drop the consolidated copy (ours is referenced by mine)
    return mine


def _tensor_parallel_group_of(rank: int) -> List[int]:
    for members in state._require("optimizer state").topology.tensor_parallel_groups():
        if rank in members:
            return list(members)
    raise ValueError(f"rank {rank} is in no tensor-parallel group")


def _local_and_agreed(model, optimizer, params: "_Params", receivers: Optional[List[int]], what: str):
    """This rank's state (None where it takes no part) and its description,
    after every rank has compared every rank's (collective)."""
    local = _local_state(optimizer, receivers)
    if local is None:
        description, problem = None, None
    else:
        description, problem = _describe(params, local)
    _agree(problem, what)
    descriptions = [description]
    if dist.is_initialized() and dist.get_world_size() > 1:
        descriptions = [None] * dist.get_world_size()
        dist.all_gather_object(descriptions, description)
    present = [(rank, d) for rank, d in enumerate(descriptions) if d is not None]
    _compare_descriptions([d for _, d in present], what, [rank for rank, _ in present])
    return local, description


class _Params:
    """The optimizer's parameters in ``state_dict()`` index order, each with
    its name in the model (without DDP's prefix) and its layout entry."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, what: str):
        names = {}
        keys = {}
        for key, param in model.named_parameters():
            names.setdefault(id(param), _plain(key))
            keys.setdefault(id(param), key)
        self.groups: List[List[int]] = []   # per group: indices
        self.params: List[torch.Tensor] = []
        self.names: List[str] = []
        self.model_keys: List[str] = []
        unknown = []
        for group in optimizer.param_groups:
            indices = []
            for param in group["params"]:
                if id(param) not in names:
                    unknown.append(f"group {len(self.groups)} position {len(indices)} "
                                   f"(shape {tuple(param.shape)})")
                    names[id(param)] = keys[id(param)] = f"<unknown {len(self.params)}>"
                indices.append(len(self.params))
                self.params.append(param)
                self.names.append(names[id(param)])
                self.model_keys.append(keys[id(param)])
            self.groups.append(indices)
        self.unknown = unknown
        self.what = what
        self.layout: Dict[str, EntryLayout] = {}

    def read_layout(self, model) -> None:
        # Collective; done after the rank verdicts so that a bad call never hangs in it.
        self.layout = model_layout(model)

    def entry(self, index: int) -> EntryLayout:
        return self.layout[self.model_keys[index]]


def _agree(problem: Optional[str], what: str) -> None:
    """Every rank learns every rank's problem before any tensor moves."""
    verdicts = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem)
    bad = [(rank, v) for rank, v in enumerate(verdicts) if v]
    if bad:
        raise OptimizerStateMismatchError(f"{what}: " + "; ".join(f"rank {r}: {v}" for r, v in bad))


def _checked_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer, what: str) -> _Params:
    """The optimizer's parameters with their layout, once every rank knows
    that each of them is the model's (collective)."""
    _check_optimizer_kind(optimizer, what)
    params = _Params(model, optimizer, what)
    _agree("the optimizer holds parameters that are not the model's: " + ", ".join(params.unknown)
           if params.unknown else None, what)
    params.read_layout(model)
    return params


def _plan_on_one_rank(src: int, make_plan, describe_error, message_prefix: str):
    """``make_plan()`` on rank ``src`` (a plan, or a string saying what is
    wrong), broadcast: every rank returns the plan or raises the same
    OptimizerStateMismatchError ``message_prefix + what is wrong``."""
    plan = None
    if state.get_rank() == src:
        try:
            plan = make_plan()
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            plan = describe_error(e)
    box = [plan]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    if isinstance(box[0], str):
        raise OptimizerStateMismatchError(message_prefix + box[0])
    return box[0]


def _typed(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _load_state(params: _Params, plan: dict, load_tensor) -> Dict[int, dict]:
    """The ``state`` of a loaded optimizer state dict: plain values from the
    plan, and each tensor from ``load_tensor(entry)``, where ``entry`` says
    where it lands on this rank (sharded like its parameter, or whole) and its
    ``key`` names it in the checkpoint."""
    result: Dict[int, dict] = {}
    for index, keys in plan["state"].items():
        out = {}
        for key, (kind, info) in keys.items():
            if kind == "value":
                out[key] = info
                continue
            dtype, shape = info
            entry_key = plan["entry_keys"][index][key]
            entry = params.entry(index)
            if kind == "sharded":
                entry = dataclasses.replace(entry, key=entry_key, dtype=dtype)
            else:
                entry = EntryLayout(entry_key, shape, shape, dtype, entry.device)
            out[key] = load_tensor(entry)
        result[index] = out
    return result


# ---------------------------------------------------------------------------- collect
def _describe(params: _Params, local: dict) -> Tuple[dict, Optional[str]]:
    """What this rank's optimizer holds, for every rank to compare: group
    hyperparameter names, parameter names and each parameter's state keys and
    kinds (and, under SHARDTORCH_DEBUG, digests of replicated state)."""
    problems = []
    if params.unknown:
        problems.append("the optimizer holds parameters that are not the model's: " + ", ".join(params.unknown))
    groups = [{"keys": sorted(k for k in g if k not in ("params", "param_names")),
               "names": [params.names[i] for i in indices]}
              for g, indices in zip(local["param_groups"], params.groups)]
    per_param = {}
    for index, values in local["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params.params):
            problems.append(f"state for index {index!r} that no parameter group lists")
            continue
        param = params.params[index]
        entry = params.layout.get(params.model_keys[index])
        kinds = {}
        for key, value in values.items():
            kind = _kind(value, param, entry)
            if kind is None:
                problems.append(f"parameter {params.names[index]!r} (sharded along dim {entry.dim}, local shape "
                                f"{tuple(param.shape)}): state {key!r} of shape {tuple(value.shape)} is neither "
                                f"shaped like the shard nor a scalar, so it cannot be gathered")
                continue
            kinds[str(key)] = [kind, str(value.dtype) if torch.is_tensor(value) else None]
            if _debug() and kind in ("replicated", "value"):
                kinds[str(key)].append(_digest(value))
        per_param[params.names[index]] = kinds
    return {"groups": groups, "state": per_param}, ("; ".join(problems) or None)


def _kind(value, param: torch.Tensor, entry: Optional[EntryLayout]) -> Optional[str]:
    if not torch.is_tensor(value) or value.dim() == 0:
        return "value"
    if entry is None or not entry.sharded:
        return "replicated"
    if tuple(value.shape) == tuple(param.shape):
        return "sharded"
    return None


def _digest(value) -> str:
    if torch.is_tensor(value):
        data = value.detach().cpu().contiguous()
        return hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest() + \
            str(tuple(value.shape))
    return repr(value)


def _compare_descriptions(descriptions: List[dict], what: str, ranks: List[int]) -> None:
    reference = descriptions[0]
    bad = []
    for rank, d in zip(ranks[1:], descriptions[1:]):
        if d["groups"] != reference["groups"]:
            bad.append(f"rank {rank}'s parameter groups {d['groups']} differ from rank 0's {reference['groups']}")
            continue
        for name in sorted(set(d["state"]) | set(reference["state"])):
            mine, ref = d["state"].get(name), reference["state"].get(name)
            if mine == ref:
                continue
            if mine is None or ref is None:
                bad.append(f"parameter {name!r} has optimizer state on rank {0 if mine is None else rank} "
                           f"but none on rank {rank if mine is None else 0}")
            elif sorted(mine) != sorted(ref):
                bad.append(f"parameter {name!r} has state {sorted(mine)} on rank {rank}, {sorted(ref)} on rank 0")
            else:
                keys = [k for k in mine if mine[k] != ref[k]]
                bad.append(f"parameter {name!r} state {keys} differs between rank 0 and rank {rank} "
                           f"({[mine[k] for k in keys]} vs {[ref[k] for k in keys]}); replicas must agree")
    if bad:
        raise OptimizerStateMismatchError(f"{what}: the ranks' optimizers disagree: " + "; ".join(bad))


def collect_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                 dst: Optional[int] = None) -> Optional[dict]:
    """The state dict the same optimizer over the unsharded model would hold.

    Args:
        model: the sharded model (DDP-wrapped or not) whose parameters
            ``optimizer`` updates.
        optimizer: a torch optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...)
            over the model's parameters (all of them or some).
        dst: None: every rank receives the result. A global rank: only ``dst``
            does (gathered from its tensor-parallel group; other ranks return None).

    Returns ``{"state", "param_groups"}`` keyed like ``optimizer.state_dict()``,
    each group carrying ``param_names`` (the unsharded model's names), ready for
    ``torch.optim.X(plain_model.parameters()).load_state_dict``.

    Collective over the world. Before any tensor moves, every rank's optimizer
    is compared (groups, names, state keys and kinds): a difference raises
    OptimizerStateMismatchError on every rank. ``dst`` holds the result plus
    at most one full tensor in flight; other ranks hold only their shards.
    """
    what = "collect_optimizer_state_dict"
    world = state.get_world_size()
    if dst is not None and not (isinstance(dst, int) and 0 <= dst < world):
        raise ValueError(f"{what}: dst must be None or a global rank in [0, {world}), got {dst!r}")
    _check_optimizer_kind(optimizer, what)
    params = _Params(model, optimizer, what)
    params.read_layout(model)
    local, description = _local_and_agreed(model, optimizer, params,
                                           None if dst is None else _tensor_parallel_group_of(dst), what)
    rank = state.get_rank()
    receives = dst is None or rank == dst
    if local is None:  # a ZeroRedundancyOptimizer's rank outside dst's tensor-parallel group
        return None
    collected: Dict[int, dict] = {}
    for index in range(len(params.params)):
        kinds = description["state"].get(params.names[index])
        if kinds is None:
            continue
        values = local["state"][index]
        out = {}
        for key, value in values.items():
            if kinds[str(key)][0] != "sharded":
                out[key] = value
                continue
            entry = dataclasses.replace(params.entry(index), key=f"{params.names[index]}:{key}",
                                        dtype=value.dtype, device=value.device)
            full = _gather_everywhere(value, entry) if dst is None else _gather_to(value, entry, dst)
            if receives:
                out[key] = full
        if receives:
            collected[index] = out
    if not receives:
        return None
    groups = []
    for group, indices in zip(local["param_groups"], params.groups):
        group = dict(group)
        group["param_names"] = [params.names[i] for i in indices]
        groups.append(group)
    return {"state": collected, "param_groups": groups}


# ---------------------------------------------------------------------------- relocate
def relocate_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                  state_dict: Optional[dict], src: int = 0, strict: bool = True) -> dict:
    """Cuts a full optimizer state dict on global rank ``src`` into this rank's
    shards; returns what ``optimizer.load_state_dict`` takes.

    Args:
        model: the sharded model (DDP-wrapped or not) whose parameters
            ``optimizer`` updates.
        optimizer: the optimizer that will load the result (same class and
            parameter groups as the one that saved it).
        state_dict: on ``src``, the full state (from collect_optimizer_state_dict
            at any size, or ``state_dict()`` of the same optimizer over the plain
            unsharded model); ignored elsewhere (pass None).
        src: the global rank that holds it.
        strict: a parameter that requires grad but has no state, while others
            of its group have some, is an error (partial state).

    Parameters are matched by ``param_names`` when the state carries them
    (collected state does; torch's does for optimizers built from named
    parameters), else by position as torch does. Hyperparameters (lr, ...)
    come from the state dict, as with torch's load_state_dict. Collective over
    the world: ``src`` checks the state against this optimizer and the model
    (groups, names, the optimizer class, state keys, full shapes) and
    broadcasts its verdict, so a mismatch raises OptimizerStateMismatchError
    on every rank naming what differs; then each rank receives only its slices.
    """
    what = "relocate_optimizer_state_dict"
    world = state.get_world_size()
    if not (isinstance(src, int) and 0 <= src < world):
        raise ValueError(f"{what}: src must be a global rank in [0, {world}), got {src!r}")
    params = _checked_params(model, optimizer, what)
    rank = state.get_rank()
    plan = _plan_on_one_rank(src, lambda: _plan_on_src(params, optimizer, state_dict, strict), _typed,
                             f"{what}: ")

    result_state: Dict[int, dict] = {}
    for index in range(len(params.params)):
        keys = plan["state"].get(index)
        if keys is None:
            continue
        saved_index = plan["saved_index"][index] if rank == src else None
        out = {}
        for key, (kind, info) in keys.items():
            if kind == "value":
                out[key] = info
                continue
            full = state_dict["state"][saved_index][key] if rank == src else None
            dtype, shape = info
            entry = params.entry(index)
            if kind == "sharded":
                out[key] = _scatter_slices(full, dataclasses.replace(entry, dtype=dtype), dtype, src)
            else:
                out[key] = _broadcast(full, dataclasses.replace(entry, full_shape=shape, local_shape=shape,
                                                                dtype=dtype), dtype, src)
            del full
        result_state[index] = out
    return {"state": result_state, "param_groups": plan["param_groups"]}


def _plan_on_src(params: _Params, optimizer, state_dict, strict: bool):
    """What every rank receives for each of this optimizer's parameters, or an
    error message naming what differs."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        return (f"src rank {state.get_rank()} must pass an optimizer state dict (a dict with 'state' and "
                f"'param_groups'), got {type(state_dict).__name__}"
                + (f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else ""))
    saved_groups = state_dict["param_groups"]
    current = optimizer.param_groups
    cls = _class_name(optimizer)
    if len(saved_groups) != len(current):
        return (f"the state has {len(saved_groups)} parameter group(s), this {cls} has {len(current)}")
    problems = []
    saved_index = {}   # this optimizer's index -> the state dict's index
    # ZeroRedundancyOptimizer's own groups gain the inner optimizer's defaults
    # only when it first syncs them; its inner optimizer has them from the start.
    inner = optimizer.optim.param_groups if _is_zero(optimizer) else current
    if len(inner) != len(current):
        inner = current
    for g, (saved, group, indices) in enumerate(zip(saved_groups, current, params.groups)):
        saved_keys = {k for k in saved if k not in ("params", "param_names")}
        keys = {k for k in group if k not in ("params", "param_names")} | \
            {k for k in inner[g] if k not in ("params", "param_names")}
        if saved_keys != keys:
            problems.append(f"group {g} has hyperparameters {sorted(saved_keys)} in the state but this {cls} has "
                            f"{sorted(keys)} (missing {sorted(keys - saved_keys)}, unexpected "
                            f"{sorted(saved_keys - keys)}): the state is of another optimizer class")
            continue
        merged = {**inner[g], **group}
        flags = [k for k in ("decoupled_weight_decay", "nesterov", "amsgrad", "centered")
                 if k in keys and bool(saved[k]) != bool(merged[k])]
        if flags:
            problems.append(f"group {g}: {', '.join(f'{k}={saved[k]!r} in the state, {merged[k]!r} here' for k in flags)}"
                            f" (the state is of another optimizer variant)")
        names = [params.names[i] for i in indices]
        saved_params = list(saved["params"])
        if "param_names" in saved:
            saved_names = [_plain(n) for n in saved["param_names"]]
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
    expected_keys = _STATE_KEYS.get(cls)
    plan_state: Dict[int, dict] = {}
    for g, (saved, indices) in enumerate(zip(saved_groups, params.groups)):
        with_state = [i for i in indices if saved_index[i] in state_dict["state"]]
        for i in indices:
            name, entry = params.names[i], params.entry(i)
            values = state_dict["state"].get(saved_index[i])
            if values is None:
                if strict and with_state and params.params[i].requires_grad:
                    problems.append(f"parameter {name!r} has no state while {len(with_state)} other(s) of group {g} "
                                    f"have some (partial optimizer state; strict=False accepts it)")
                continue
            if expected_keys is not None:
                required, allowed = expected_keys[0](saved), expected_keys[1]
                keys = {str(k) for k in values}
                if keys - allowed or required - keys:
                    problems.append(f"parameter {name!r} has state {sorted(keys)}, {cls} keeps {sorted(required)}"
                                    + (f" (missing {sorted(required - keys)})" if required - keys else "")
                                    + (f" (unexpected {sorted(keys - allowed)})" if keys - allowed else ""))
                    continue
            plan = {}
            for key, value in values.items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    plan[key] = ("value", value)
                elif tuple(value.shape) == tuple(entry.full_shape):
                    plan[key] = ("sharded" if entry.sharded else "replicated", (value.dtype, tuple(value.shape)))
                elif entry.sharded:
                    problems.append(f"parameter {name!r} state {key!r} has shape {tuple(value.shape)}, neither the "
                                    f"parameter's full shape {tuple(entry.full_shape)} nor a scalar")
                else:
                    plan[key] = ("replicated", (value.dtype, tuple(value.shape)))
            plan_state[i] = plan
    if problems:
        return "the optimizer state does not fit this optimizer: " + "; ".join(problems)
    groups = []
    for saved, indices in zip(saved_groups, params.groups):
        group = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        group["params"] = list(indices)
        group["param_names"] = [params.names[i] for i in indices]
        groups.append(group)
    return {"state": plan_state, "param_groups": groups, "saved_index": saved_index}


# ---------------------------------------------------------------------------- sharded checkpoints
OPTIMIZER_META_KEY = "__optimizer__"


def _entry_key(name: str, key) -> str:
    return f"optimizer/{name}/{key}"


def sharded_optimizer_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              layout: Dict[str, EntryLayout], what: str = "save_sharded",
                              every_rank: bool = False):
    """This rank's optimizer state as extra sharded-checkpoint entries:
    ({entry key: tensor}, {entry key: EntryLayout}, meta). Tensor state is laid
    out like its parameter (sharded or replicated); scalar state, the groups
    and the names go in ``meta``, which global rank 0 writes. Collective: the
    ranks' optimizers are compared first, as collect_optimizer_state_dict does."""
    _check_optimizer_kind(optimizer, what)
    params = _Params(model, optimizer, what)
    params.layout = layout if all(k in layout for k in params.model_keys) else model_layout(model)
    # The ranks of the first tensor-parallel group write the shards (and rank 0 the rest),
    # unless every rank takes part (DCP).
    local, description = _local_and_agreed(model, optimizer, params,
                                           None if every_rank else _tensor_parallel_group_of(0), what)
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
            ek = _entry_key(name, key)
            if kind == "sharded":
                layouts[ek] = dataclasses.replace(params.entry(index), key=ek, local_shape=tuple(value.shape),
                                                  dtype=value.dtype, device=value.device)
            else:
                shape = tuple(value.shape)
                layouts[ek] = EntryLayout(ek, shape, shape, value.dtype, value.device)
            tensors[ek] = value
            tensor_keys.setdefault(name, []).append((key, ek))
        values.setdefault(name, [])
    groups = []
    for group, indices in zip(local["param_groups"], params.groups):
        group = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        group["param_names"] = [params.names[i] for i in indices]
        groups.append(group)
    meta = {"optimizer": _class_name(optimizer), "param_groups": groups, "values": values,
            "tensors": tensor_keys,
            "shapes": {ek: {"shape": list(e.full_shape), "dtype": str(e.dtype).replace("torch.", "")}
                       for ek, e in layouts.items()}}
    return tensors, layouts, meta


def _skeleton(meta: dict, entries: dict) -> dict:
    """A full optimizer state dict of meta tensors (shapes and dtypes only),
    keyed by position in the saved groups, for the checks of _plan_on_src."""
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
            entry = entries[ek]
            values[key] = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]), device="meta")
        state_dict["state"][position[name]] = values
    return state_dict


def _plan_from_meta(params: _Params, optimizer, meta: dict, shapes: dict, strict: bool):
    """_plan_on_src for a checkpoint's meta, plus each state tensor's entry key."""
    if meta["optimizer"] != _class_name(optimizer):
        return f"the checkpoint holds {meta['optimizer']} state, this optimizer is a {_class_name(optimizer)}"
    skeleton = _skeleton(meta, shapes)
    plan = _plan_on_src(params, optimizer, skeleton, strict)
    if not isinstance(plan, str):
        names = {i: n for g in skeleton["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        plan["entry_keys"] = {i: dict(meta["tensors"].get(names[plan["saved_index"][i]], []))
                              for i in plan["state"]}
    return plan


def load_sharded_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                      path: str, strict: bool = True) -> dict:
    """This rank's optimizer state dict (for ``optimizer.load_state_dict``)
    from a sharded checkpoint that save_sharded wrote with ``optimizer=``, at
    any tensor-parallel and data-parallel size. Collective; rank 0 checks the
    checkpoint and the state against this optimizer (as
    relocate_optimizer_state_dict does) and every rank raises on a mismatch."""
    from . import sharded_format as fmt
    from .sharded_load import _assemble

    what = "load_sharded"
    params = _checked_params(model, optimizer, what)

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
        plan = _plan_from_meta(params, optimizer, contents[section["key"]], section["entries"], strict)
        if not isinstance(plan, str):
            plan["directory"] = directory
            plan["entries"] = {ek: section["entries"][ek] for keys in plan["entry_keys"].values()
                               for ek in keys.values()}
        return plan

    plan = _plan_on_one_rank(0, make_plan, lambda e: str(e).replace("load_sharded: ", "", 1),
                             f"{what}: optimizer state: ")
    files: Dict[str, dict] = {}
    result_state = _load_state(params, plan, lambda entry: _assemble(entry, plan["entries"][entry.key],
                                                                     plan["directory"], files))
    return {"state": result_state, "param_groups": plan["param_groups"]}


# ---------------------------------------------------------------------------- DCP
DCP_META_KEY = "optimizer/__meta__"


def dcp_optimizer_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          layout: Dict[str, EntryLayout]):
    """This rank's optimizer state as DCP entries ({key: tensor}, {key: layout})
    plus the meta object under DCP_META_KEY. Collective."""
    tensors, layouts, meta = sharded_optimizer_entries(model, optimizer, layout, "save_dcp", every_rank=True)
    return tensors, layouts, meta


def dcp_optimizer_plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: Optional[dict],
                       strict: bool = True):
    """(params, plan) for loading a DCP checkpoint's optimizer state: every
    rank read the same ``meta``; rank 0's verdict decides for all."""
    what = "load_dcp"
    params = _checked_params(model, optimizer, what)

    def make_plan():
        if meta is None:
            return "the checkpoint holds no optimizer state (saved without save_dcp(..., optimizer=...))"
        return _plan_from_meta(params, optimizer, meta, meta["shapes"], strict)

    return params, _plan_on_one_rank(0, make_plan, _typed, f"{what}: optimizer state: ")
