"""The two keyings of an optimizer state dict, and the conversion between them.

torch's ``optimizer.state_dict()`` keys ``state`` by integer ids and lists the
ids in each group's ``params`` (plus the names in ``param_names`` when the
optimizer was built from named parameters). torch.distributed.checkpoint.
state_dict's get_optimizer_state_dict / set_optimizer_state_dict key ``state``
by each parameter's fully qualified name (FQN: its name in the model, DDP's
"module." removed) and list FQNs in ``params``. shardtorch plans with the
first; these turn one into the other, so that either is accepted wherever a
state dict comes in and either can be handed out.
"""
from typing import Dict, List

from ..verify import strip_ddp_prefix
from .params import hyperparameters


class StateDictFormError(ValueError):
    """A state dict that is neither keying consistently."""


def is_fqn_keyed(state_dict: dict) -> bool:
    """True for the FQN-keyed form (names in ``params``), False for integer
    ids; raises StateDictFormError when the groups mix the two."""
    kinds = set()
    for g, group in enumerate(state_dict["param_groups"]):
        params = list(group.get("params", ()))
        names = [p for p in params if isinstance(p, str)]
        if names and len(names) != len(params):
            raise StateDictFormError(
                f"group {g} lists both parameter names {names[:3]} and integer ids "
                f"{[p for p in params if not isinstance(p, str)][:3]} in 'params'; "
                f"an optimizer state dict keys parameters by one or the other")
        if params:
            kinds.add(bool(names))
    if not kinds:  # no group lists a parameter: the state's keys decide
        kinds = {isinstance(k, str) for k in state_dict["state"]}
    if len(kinds) > 1:
        raise StateDictFormError("some parameter groups list parameter names, others integer ids, "
                                 "in 'params'; an optimizer state dict keys parameters by one or the other")
    return kinds == {True}


def indexed(state_dict: dict) -> dict:
    """``state_dict`` keyed by integer ids: the id form as it is; the FQN form
    with ids numbered through its groups in order (as torch's state_dict()
    numbers them) and the FQNs in ``param_names``, so parameters are matched
    by name. No tensor is copied. Raises StateDictFormError naming what is
    inconsistent (a name listed twice, state of a name no group lists, state
    keyed by both)."""
    if not is_fqn_keyed(state_dict):
        return state_dict
    position: Dict[str, int] = {}
    groups = []
    for g, group in enumerate(state_dict["param_groups"]):
        names: List[str] = []
        for fqn in group["params"]:
            name = strip_ddp_prefix(fqn)
            if name in position:
                raise StateDictFormError(f"parameter {fqn!r} is listed twice in the param_groups")
            position[name] = len(position)
            names.append(name)
        groups.append({**hyperparameters(group), "params": [position[n] for n in names], "param_names": names})
    ids = [k for k in state_dict["state"] if not isinstance(k, str)]
    if ids:
        raise StateDictFormError(f"'state' is keyed by parameter names and by integer ids {ids[:5]}; "
                                 f"an optimizer state dict keys parameters by one or the other")
    unlisted = [k for k in state_dict["state"] if strip_ddp_prefix(k) not in position]
    if unlisted:
        raise StateDictFormError(f"state for parameter(s) {unlisted} that no parameter group lists")
    state = {position[strip_ddp_prefix(k)]: v for k, v in state_dict["state"].items()}
    return {"state": state, "param_groups": groups}


def fqn_keyed(state_dict: dict) -> dict:
    """An id-keyed state dict whose groups carry ``param_names`` in the FQN
    form that torch.distributed.checkpoint.state_dict's
    set_optimizer_state_dict loads (``param_names`` dropped: ``params`` names them)."""
    name_of = {}
    groups = []
    for group in state_dict["param_groups"]:
        name_of.update(zip(group["params"], group["param_names"]))
        groups.append({**hyperparameters(group), "params": list(group["param_names"])})
    return {"state": {name_of[k]: v for k, v in state_dict["state"].items()}, "param_groups": groups}


def flattened_hint(state_dict) -> str:
    """Why a dict without 'state' and 'param_groups' is refused, when it is
    torch's flattened form."""
    if isinstance(state_dict, dict) and any(isinstance(k, str) and k.startswith(("state.", "param_groups."))
                                            for k in state_dict):
        return (" (torch's flattened form, StateDictOptions(flatten_optimizer_state_dict=True); "
                "pass the nested form)")
    return ""
