"""Plans a model declares: where no known layout applies (a model's own code, ``trust_remote_code``),
the tensor-parallel plan transformers reads from the model is used instead, and proven like any other.

transformers declares it as ``base_model_tp_plan`` on the config (names relative to the base model,
``layers.*.self_attn.q_proj``) and ``_tp_plan`` on the model (names relative to the model,
``lm_head``), ``*`` standing for a layer number. Its "colwise" is a "column" placement here (the
output features split, contiguously) and "rowwise" a "row" one (the input features split, the
output all-reduced), both by whole heads where the module holding the projection has a ``head_dim``
that divides its features (as transformers' attention does), so that a forward that views its
projections as ``(-1, head_dim)`` heads computes whole heads on every rank. Other styles (fused or packed projections, gathers, experts, sequence
parallelism) are not read: what they name stays whole, which is exact. A declared plan says where to
cut, not that the model's forward computes per-rank heads from the shards (a head count read from
an attribute, say); the proof finds it if not.
"""
import re
from typing import Dict, List, Tuple

from torch import nn

from .layers import is_projection, projection_sizes

STYLES = {"colwise": "column", "rowwise": "row"}


def declared_plan(model: nn.Module) -> Dict[str, str]:
    """{name pattern over ``model.named_modules()``: transformers' style}, from the config's
    ``base_model_tp_plan`` and the model's ``_tp_plan`` (empty when it declares none)."""
    declared: Dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, dict):
        prefix = getattr(model, "base_model_prefix", "")
        prefix = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        declared.update({prefix + k: v for k, v in base.items()})
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, dict):
        declared.update(own)
    return {k: v for k, v in declared.items() if isinstance(k, str) and isinstance(v, str)}


def _matcher(pattern: str) -> "re.Pattern[str]":
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + r"\Z")


def declared_styles(model: nn.Module, taken: List[str]) -> Dict[str, Tuple[str, int]]:
    """{module name: ("column" / "row", unit)} for each projection the declared plan names that no known
    layout holds (``taken``: names already placed; a module inside one, or holding one, is left to it)."""
    patterns = [(_matcher(p), STYLES[s]) for p, s in declared_plan(model).items() if s in STYLES]
    if not patterns:
        return {}
    found: Dict[str, Tuple[str, int]] = {}
    for name, module in model.named_modules():
        if not name or not is_projection(module) or _overlaps(name, taken):
            continue
        style = next((style for matcher, style in patterns if matcher.match(name)), None)
        if style is not None:
            found[name] = (style, _head_unit(model, name, module, style))
    return found


def _head_unit(model: nn.Module, name: str, module: nn.Module, style: str) -> int:
    """The head width of the module holding the projection, where it divides the split features; else 1."""
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    unit = getattr(parent, "head_dim", None)
    features = projection_sizes(module)[1 if style == "column" else 0]
    return unit if isinstance(unit, int) and unit > 0 and features % unit == 0 else 1


def _overlaps(name: str, taken: List[str]) -> bool:
    return any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken)
