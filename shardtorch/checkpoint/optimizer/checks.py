"""Checks shared by every optimizer-state call: each rank's optimizer against
the model and against the other ranks', before any tensor moves, so that a
mismatch raises OptimizerStateMismatchError on every rank naming what differs
(never a wrong transfer, never a hang)."""
import hashlib
import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ...distributed import state
from ..verify import CheckpointMismatchError, agree_on_problems, broadcast_verdict
from .params import OptimizerParams, hyperparameters, is_zero, state_kind


class OptimizerStateMismatchError(CheckpointMismatchError):
    """The optimizer state does not fit the optimizer or the model."""


def debug() -> bool:
    return os.environ.get("SHARDTORCH_DEBUG", "0") not in ("", "0")


def check_optimizer_kind(optimizer, what: str) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_zero(optimizer):
        zero_ranks = dist.get_process_group_ranks(optimizer.process_group)
        dp_ranks = state.get_group_ranks(state.DATA_PARALLEL)
        if sorted(zero_ranks) != sorted(dp_ranks):
            # Over other ranks, one parameter index would stand for different shards.
            raise NotImplementedError(
                f"{what}: a ZeroRedundancyOptimizer must run over the data-parallel group "
                f"(ranks {dp_ranks} for rank {state.get_rank()}), this one runs over ranks {zero_ranks}")


def agree(problem: Optional[str], what: str) -> None:
    """Every rank learns every rank's problem before any tensor moves."""
    agree_on_problems(problem, f"{what}: ", OptimizerStateMismatchError)


def unknown_params_problem(params: OptimizerParams) -> Optional[str]:
    if not params.unknown:
        return None
    return "the optimizer holds parameters that are not the model's: " + ", ".join(params.unknown)


def checked_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer, what: str) -> OptimizerParams:
    """The optimizer's parameters with their layout, once every rank knows
    that each of them is the model's (collective)."""
    check_optimizer_kind(optimizer, what)
    params = OptimizerParams(model, optimizer)
    agree(unknown_params_problem(params), what)
    params.read_layout(model)
    return params


def plan_on_one_rank(src: int, make_plan, what: str, describe_error=None):
    """``make_plan()`` on rank ``src`` (a plan, or a string saying what is
    wrong), broadcast: every rank returns the plan or raises the same
    OptimizerStateMismatchError ``what: `` + what is wrong. An exception in
    ``make_plan`` is described by ``describe_error`` (default: its type and message)."""
    plan = None
    if state.get_rank() == src:
        try:
            plan = make_plan()
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            plan = (describe_error or typed)(e)
    return broadcast_verdict(plan, src, what, OptimizerStateMismatchError)


def typed(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------------------- the ranks compared
def describe(params: OptimizerParams, local: dict) -> Tuple[dict, Optional[str]]:
    """What this rank's optimizer holds, for every rank to compare: group
    hyperparameter names, parameter names and each parameter's state keys and
    kinds (and, under SHARDTORCH_DEBUG, digests of replicated state), with
    this rank's problems (None: none)."""
    problems = [p for p in [unknown_params_problem(params)] if p]
    groups = [{"keys": sorted(hyperparameters(g)),
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
            row_state = str(key) in params.row_keys
            kind = state_kind(value, param, entry, row_state)
            if kind is None:
                rows = f", one value per row ({param.shape[0]})," if row_state else ""
                problems.append(f"parameter {params.names[index]!r} (sharded along dim {entry.dim}, local shape "
                                f"{tuple(param.shape)}): state {key!r} of shape {tuple(value.shape)} is neither "
                                f"shaped like the shard{rows} nor a scalar, so it cannot be gathered")
                continue
            kinds[str(key)] = [kind, str(value.dtype) if torch.is_tensor(value) else None]
            if debug() and kind in ("replicated", "value"):
                kinds[str(key)].append(_digest(value))
        per_param[params.names[index]] = kinds
    return {"groups": groups, "state": per_param}, ("; ".join(problems) or None)


def _digest(value) -> str:
    if torch.is_tensor(value):
        data = value.detach().cpu().contiguous()
        return hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest() + \
            str(tuple(value.shape))
    return repr(value)


def compare_descriptions(descriptions: List[dict], what: str, ranks: List[int]) -> None:
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
