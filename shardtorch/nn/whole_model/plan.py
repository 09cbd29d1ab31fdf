"""The plan: {qualified module name: style}, data a user can print, edit and
pass back. ``auto_plan`` discovers it; ``resolve`` reads each entry's module
once, finding its layout (a Placement keeps it for ``parallelize`` to apply),
and refuses a bad plan with the same error on every rank (it reads only the
model, identical everywhere, and runs before anything is split). ``read_again``
rebuilds the placements a kept proof recorded (proof_cache.py)."""
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from torch import nn

from .declared_plan import declared_styles
from .layers import is_projection, projection_sizes
from .layouts import ATTENTION_LAYOUTS, EXPERT_LAYOUTS, KINDS, MLP_LAYOUTS, find_layout
from .layouts.base import Fit, Layout
from .layouts.families import WHOLE_ATTENTION_CLASSES
from .lora import lora_lifted, peft_base_model
from .vocabulary import find_vocabulary, tied_vocabulary_holders, vocabulary_refusal

#: The styles a plan entry may name.
STYLES = ("attention", "mlp", "experts", "column", "row", "vocab", "replicate")


@dataclass
class Placement:
    """One plan entry resolved: the module it names and, for a layout style, the layout and what it read."""
    name: str
    style: str
    module: nn.Module
    layout: Optional[Layout] = None
    fit: Optional[Fit] = None
    unit: int = 1  # "column" / "row": features split in groups of this many (a head's, for a declared plan)
    declared: bool = False  # read from the plan the model declares: left whole where it cannot split


def _discover(model: nn.Module) -> List[Placement]:
    placements = []
    for name, module in model.named_modules():
        found = find_layout(module)
        if found is not None:
            placements.append(Placement(name, found[0].kind, module, *found))
    vocabulary = [name for name in find_vocabulary(model) if name is not None]
    for name in vocabulary + tied_vocabulary_holders(model, vocabulary):
        if all(p.name != name for p in placements):
            placements.append(Placement(name, "vocab", model.get_submodule(name)))
    # Where no known layout applies, the plan the model declares (declared_plan.py).
    for name, (style, unit) in declared_styles(model, [p.name for p in placements]).items():
        placements.append(Placement(name, style, model.get_submodule(name), unit=unit, declared=True))
    return placements


def auto_plan(model: nn.Module) -> Dict[str, str]:
    """The plan ``parallelize(model)`` applies: every attention, MLP and
    experts bank of a known layout, and the token embedding and LM head by
    vocabulary (with every module tied to them); where no known layout
    applies, the "colwise" / "rowwise" projections of the tensor-parallel plan
    a transformers model declares (declared_plan.py). What it does not name stays
    whole (``unplaced`` lists what that leaves). A peft PeftModel's plan is its
    base model's, its LoRA layers read as the projections they wrap."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_plan: model must be a torch.nn.Module, got {type(model).__name__}")
    base = peft_base_model(model)
    model = model if base is None else base  # a PeftModel: its base model's plan, as parallelize applies it
    with lora_lifted(model):
        return {p.name: p.style for p in _discover(model)}


def resolve(model: nn.Module, plan: Union[str, Dict[str, str]], size: int,
            sequence_parallel: bool = False) -> List[Placement]:
    """The plan's entries with their modules and layouts, in model order. Raises ValueError naming every
    entry that names no module of ``model``, no style, or a module the style cannot split over ``size``
    ranks."""
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"parallelize: plan must be 'auto' or a dict {{module name: style}}, got {plan!r}")
        placements = _discover(model)
    elif isinstance(plan, dict):
        placements = _read(model, plan)
    else:
        raise TypeError(f"parallelize: plan must be 'auto' or a dict {{module name: style}}, got "
                        f"{type(plan).__name__}")
    problems = [p for p in placements if isinstance(p, str)]
    placements = [p for p in placements if not isinstance(p, str)]
    placements = [p for p in placements if not (p.declared and _refusal(p, size, sequence_parallel))]
    for placement in placements:
        reason = _refusal(placement, size, sequence_parallel)
        if reason is not None:
            problems.append(f"{placement.name!r} ({type(placement.module).__name__}) as {placement.style!r}: "
                            f"{reason}")
    if problems:
        raise ValueError("parallelize: the plan cannot be applied: " + "; ".join(problems))
    order = {name: i for i, name in enumerate(dict(model.named_modules()))}
    return sorted(placements, key=lambda p: order[p.name])


def read_again(model: nn.Module, kept: list, size: int, sequence_parallel: bool) -> Optional[List[Placement]]:
    """The placements a kept proof recorded ((name, style, layout class, variant, unit, declared), in model
    order: proof_cache.placements_kept), read again on ``model``: each layout's fit taken anew. None where
    one no longer names a module, fits or applies (the plan is then resolved)."""
    modules = dict(model.named_modules())
    layouts = {type(layout).__name__: layout for layout in ATTENTION_LAYOUTS + MLP_LAYOUTS + EXPERT_LAYOUTS}
    placements = []
    for name, style, layout_name, variant, unit, declared in kept:
        module = modules.get(name)
        if module is None or style not in STYLES:
            return None
        layout = fit = None
        if layout_name:
            layout = layouts.get(layout_name)
            fit = layout.fit(module) if layout is not None and layout.kind == style else None
            if fit is None or repr(getattr(fit, "variant", None)) != variant:
                return None
        placement = Placement(name, style, module, layout, fit, unit, declared)
        if _refusal(placement, size, sequence_parallel) is not None:
            return None
        placements.append(placement)
    return placements


def _read(model: nn.Module, plan: Dict[str, str]) -> list:
    """A user's plan as Placements (and problem strings), with the modules tied to its vocabulary."""
    modules = dict(model.named_modules())
    read: list = []
    for name, style in plan.items():
        if name not in modules:
            read.append(f"{name!r} names no module of the model")
        elif style not in STYLES:
            read.append(f"{name!r}: style must be one of {', '.join(STYLES)}, got {style!r}")
        elif style in KINDS:
            module = modules[name]
            found = find_layout(module, style)
            if found is None:
                read.append(f"{name!r} ({type(module).__name__}) as {style!r}: {_unknown(module, style)}")
            else:
                read.append(Placement(name, style, module, *found))
        else:
            read.append(Placement(name, style, modules[name]))
    vocabulary = [name for name, style in plan.items() if style == "vocab" and name in modules]
    for name in tied_vocabulary_holders(model, vocabulary):
        if name not in plan:  # its forward would read the shard as a whole table: it follows the vocabulary
            read.append(Placement(name, "vocab", modules[name]))
    return read


def _unknown(module: nn.Module, style: str) -> str:
    if isinstance(module, WHOLE_ATTENTION_CLASSES):
        return ("torch.nn.MultiheadAttention computes its heads inside F.multi_head_attention_forward from "
                "the whole in_proj_weight and embed_dim, so no per-rank head count can make its own forward "
                "compute a shard; it is not split (see docs/parallelize.md)")
    return f"not a known {style} layout (known: see shardtorch.nn.whole_model.layouts)"


def _refusal(placement: Placement, size: int, sequence_parallel: bool) -> Optional[str]:
    module, style = placement.module, placement.style
    if placement.layout is not None:
        if sequence_parallel and not getattr(placement.fit, "sequence_parallel", placement.layout.sequence_parallel):
            return (f"this {style} placement ({placement.fit.variant}) cannot run inside a sequence-parallel "
                    f"region")
        return placement.layout.refusal(module, placement.fit, size)
    if style in ("column", "row"):
        if not is_projection(module):
            return "'column' and 'row' apply to torch.nn.Linear or Conv1D"
        in_features, out_features = projection_sizes(module)
        count = (out_features if style == "column" else in_features) // placement.unit
        what = "features" if placement.unit == 1 else f"heads of {placement.unit} features"
        return None if count >= size else f"{count} {what} cannot be split over {size} ranks"
    if style == "vocab":
        return vocabulary_refusal(module, size)
    return None
