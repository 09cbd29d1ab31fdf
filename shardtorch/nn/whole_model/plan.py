"""The plan: {qualified module name: style}, data a user can print, edit and
pass back. ``auto_plan`` discovers it; ``check_plan`` refuses a bad one with
the same error on every rank (it reads only the model, identical everywhere,
and runs before any collective)."""
from typing import Dict, List, Optional

from torch import nn

from .blocks import find_layout
from .layers import is_projection, projection_sizes
from .vocabulary import find_vocabulary

#: The styles a plan entry may name.
STYLES = ("attention", "mlp", "column", "row", "vocab", "replicate")


def auto_plan(model: nn.Module) -> Dict[str, str]:
    """The plan ``parallelize(model)`` applies: every attention and MLP of a
    known layout, and the token embedding and LM head by vocabulary. What it
    does not name stays whole (``unplaced`` lists what that leaves)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_plan: model must be a torch.nn.Module, got {type(model).__name__}")
    plan = {}
    for name, module in model.named_modules():
        layout = find_layout(module)
        if layout is not None:
            plan[name] = layout.kind
    for name in find_vocabulary(model):
        if name is not None:
            plan[name] = "vocab"
    return plan


def check_plan(model: nn.Module, plan: Dict[str, str], size: int) -> None:
    """Raises ValueError naming every entry that names no module of ``model``,
    no style, or a module the style cannot split over ``size`` ranks."""
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize: plan must be 'auto' or a dict {{module name: style}}, got "
                        f"{type(plan).__name__}")
    modules = dict(model.named_modules())
    problems: List[str] = []
    for name, style in plan.items():
        if name not in modules:
            problems.append(f"{name!r} names no module of the model")
            continue
        if style not in STYLES:
            problems.append(f"{name!r}: style must be one of {', '.join(STYLES)}, got {style!r}")
            continue
        reason = _refusal(modules[name], style, size)
        if reason is not None:
            problems.append(f"{name!r} ({type(modules[name]).__name__}) as {style!r}: {reason}")
    if problems:
        raise ValueError("parallelize: the plan cannot be applied: " + "; ".join(problems))


def _refusal(module: nn.Module, style: str, size: int) -> Optional[str]:
    if style in ("attention", "mlp"):
        if isinstance(module, (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            return ("torch.nn.MultiheadAttention computes its heads inside F.multi_head_attention_forward from "
                    "the whole in_proj_weight and embed_dim, so no per-rank head count can make its own forward "
                    "compute a shard; it is not split (see docs/parallelize.md)")
        layout = find_layout(module, style)
        if layout is None:
            return f"not a known {style} layout (known: see shardtorch.nn.whole_model.blocks)"
        return layout.refusal(module, size)
    if style in ("column", "row"):
        if not is_projection(module):
            return "'column' and 'row' apply to torch.nn.Linear or Conv1D"
        in_features, out_features = projection_sizes(module)
        count = out_features if style == "column" else in_features
        return None if count >= size else f"{count} features cannot be split over {size} ranks"
    if style == "vocab":
        if type(module) is nn.Embedding:
            rows = module.num_embeddings
        elif type(module) is nn.Linear:
            rows = module.out_features
        else:
            return "'vocab' applies to torch.nn.Embedding or torch.nn.Linear"
        return None if rows >= size else f"{rows} vocabulary rows cannot be split over {size} ranks"
    return None


def unplaced(model: nn.Module) -> List[str]:
    """Layers left whole that a plan might have split: projections, embeddings
    and attention modules of unknown layout (nn.MultiheadAttention included)."""
    from .layers import ColumnProjection, ReplicatedKeyValue, RowProjection
    placed = (ColumnProjection, RowProjection, ReplicatedKeyValue)
    found = []
    for name, module in model.named_modules():
        if isinstance(module, placed):
            continue
        kind = type(module).__name__
        if is_projection(module) or type(module) is nn.Embedding or isinstance(module, nn.MultiheadAttention):
            found.append(f"{name or '(root)'} ({kind})")
        elif ("Attention" in kind or "Attn" in kind) and not any(isinstance(m, placed) for m in module.modules()):
            found.append(f"{name or '(root)'} ({kind}: attention of unknown layout)")
    return found
