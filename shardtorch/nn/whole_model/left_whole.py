"""What a parallelized model still holds whole that a plan might have split:
listed by ``unplaced`` (and ``verbose=True``), and warned about where it is
an attention, an MLP, an experts bank or the vocabulary, which the goals of
``parallelize`` are to split. Layers meant to stay whole (position tables,
norms, a small classifier, a router) are listed, not warned about."""
from typing import List, Tuple

from torch import nn

from ..embedding import ParallelEmbedding
from ..linear import ParallelLinear
from ...utils.shard_facts import registered_shards
from .layers import ColumnProjection, ReplicatedKeyValue, RowProjection, is_projection
from .layouts.experts import is_experts_like
from .layouts.families import ATTENTION_CLASS_WORDS
from .layouts.mlp import is_mlp_like
from .vocabulary import find_vocabulary

_PLACED = (ColumnProjection, RowProjection, ReplicatedKeyValue, ParallelEmbedding, ParallelLinear)
#: The kinds of whole layers that ``parallelize`` warns about.
WARNED = ("attention", "MLP", "experts", "vocabulary")


def _placed(module: nn.Module) -> bool:
    return isinstance(module, _PLACED) or bool(registered_shards(module))


def _holds_placed(module: nn.Module) -> bool:
    return any(_placed(m) for m in module.modules())


def left_whole(model: nn.Module) -> List[Tuple[str, str, str]]:
    """(name, class name, kind) of every layer left whole that could be split: kind is one of WARNED, or
    "projection" / "embedding" for a single layer."""
    vocabulary = {name for name in find_vocabulary(model) if name is not None}
    found, inside_listed = [], ()
    for name, module in model.named_modules():
        if inside_listed and any(name.startswith(prefix + ".") for prefix in inside_listed):
            continue
        if _placed(module):
            continue
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Module) and _placed(base):  # peft's LoRA layer around a split projection
            inside_listed += (name,)
            continue
        cls = type(module).__name__
        kind = None
        if name in vocabulary:
            kind = "vocabulary"
        elif isinstance(module, nn.MultiheadAttention):
            kind = "attention"
        elif any(word in cls for word in ATTENTION_CLASS_WORDS) and any(is_projection(m) for m in module.modules()):
            kind = "attention" if not _holds_placed(module) else None
        elif is_mlp_like(module) is not None:
            kind = "MLP" if not _holds_placed(module) else None
        elif is_experts_like(module):
            kind = "experts"
        elif is_projection(module):
            kind = "projection"
        elif isinstance(module, nn.Embedding):
            kind = "embedding"
        if kind is not None:
            found.append((name or "(root)", cls, kind))
            if kind in WARNED:
                inside_listed += (name,)
    return found


_WHY = {"attention": "attention of unknown layout", "MLP": "MLP of unknown layout",
        "experts": "experts left whole", "vocabulary": "vocabulary left whole"}


def describe(entry: Tuple[str, str, str]) -> str:
    name, cls, kind = entry
    if cls == "MultiheadAttention":
        return f"{name} ({cls}): its heads are computed inside F.multi_head_attention_forward"
    return f"{name} ({cls})" + (f": {_WHY[kind]}" if kind in _WHY else "")


def unplaced(model: nn.Module) -> List[str]:
    """Layers left whole that a plan might have split: attention, MLPs and experts of unknown layout
    (nn.MultiheadAttention included), a vocabulary left whole, and single projections and embeddings."""
    return [describe(entry) for entry in left_whole(model)]
