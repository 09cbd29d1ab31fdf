"""The vocabulary end of a model: the token embedding and the LM head split
by vocabulary rows, every module tied to them following (T5's encoder and
decoder ``embed_tokens`` share the ``shared`` table), and the logits left
sharded (marked) for the loss (loss.py).

An embedding may be an ``nn.Embedding`` subclass that post-processes the
lookup (Gemma's ``embed_tokens`` multiplies it by sqrt(width)): it keeps its
class and what it adds, and only the table lookup underneath becomes the
vocabulary-parallel one (``VocabShardLookup``), so its own forward runs
unchanged on the whole looked-up rows. Whether its forward does look up
through ``super().forward`` is not read from its source: a forward that
reads the table itself gets this rank's rows only, and the proof
(proof.py) finds the vocabulary-parallel embedding's output differing from
the whole one's and refuses the split, naming the plan that keeps it
whole."""
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...distributed import state
from ...utils.shard_facts import register_shard
from ...utils.shards import shard_range
from ..embedding import ParallelEmbedding
from ..linear import ParallelLinear


def find_vocabulary(model: nn.Module) -> Tuple[Optional[str], Optional[str]]:
    """(name of the token embedding, name of the LM head), either None.

    A Hugging Face model names them (``get_input_embeddings`` /
    ``get_output_embeddings``). Otherwise an nn.Embedding counts as the
    vocabulary when an nn.Linear maps its width back to its rows (an LM head,
    tied or not); a position embedding has no such head and stays whole."""
    names = {id(m): n for n, m in model.named_modules()}
    embedding = head = None
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            found = getattr(model, getter)() if callable(getattr(model, getter, None)) else None
        except (NotImplementedError, AttributeError):
            found = None
        if getter == "get_input_embeddings" and isinstance(found, nn.Embedding):
            embedding = names.get(id(found))
        if getter == "get_output_embeddings" and isinstance(found, nn.Linear):
            head = names.get(id(found))
    if embedding is not None or head is not None:
        return embedding, head
    embeddings = [(n, m) for n, m in model.named_modules() if type(m) is nn.Embedding]
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    for emb_name, emb in embeddings:
        for lin_name, lin in linears:
            if lin.out_features == emb.num_embeddings and lin.in_features == emb.embedding_dim:
                return emb_name, lin_name
    return None, None


def tied_vocabulary_holders(model: nn.Module, names: List[str]) -> List[str]:
    """The other modules whose ``weight`` is the weight of one of the modules ``names`` (tied embeddings
    and heads), in model order: each must become vocabulary-parallel too, or its forward would read the
    shard as the whole table."""
    modules = dict(model.named_modules())
    weights = {id(modules[n]._parameters.get("weight")) for n in names if n in modules}
    weights.discard(id(None))
    return [name for name, module in modules.items() if name not in names
            and id(module._parameters.get("weight")) in weights]


def vocabulary_refusal(module: nn.Module, size: int) -> Optional[str]:
    if isinstance(module, nn.Embedding):
        if type(module) is not nn.Embedding and module.max_norm is not None:
            # The lookup beneath a subclass (VocabShardLookup) does not renormalise rows as ParallelEmbedding does.
            return (f"{type(module).__name__} has max_norm={module.max_norm}: its lookup renormalises the rows it "
                    f"reads, which the vocabulary-parallel lookup beneath an nn.Embedding subclass does not do")
        rows = module.num_embeddings
    elif isinstance(module, nn.Linear):
        if type(module).forward is not nn.Linear.forward:
            return f"{type(module).__name__} overrides nn.Linear's forward"
        rows = module.out_features
    else:
        return "'vocab' applies to torch.nn.Embedding (or a subclass that post-processes its lookup) or torch.nn.Linear"
    return None if rows >= size else f"{rows} vocabulary rows cannot be split over {size} ranks"


class VocabShardLookup(nn.Embedding):
    """The lookup of a vocabulary-parallel nn.Embedding subclass: this rank's rows of the table, the
    group's rows summed (torch.ops.shard.parallel_embedding, as ParallelEmbedding(dim=0)). Mixed in
    beneath the subclass, so its own forward (super().forward, then its post-processing) runs on the
    whole looked-up rows."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.device.type == "cpu" and input.numel() > 0:
            low, high = int(input.min()), int(input.max())
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(f"{type(self).__name__}: indices must be in [0, num_embeddings = "
                                 f"{self.num_embeddings}), got values in [{low}, {high}]")
        return torch.ops.shard.parallel_embedding(input, self.weight, self.padding_idx, 0, self.num_embeddings,
                                                  self.scale_grad_by_freq, self.sparse, self.group)


_SHARDED_CLASSES: Dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    """``cls`` with the vocabulary-parallel lookup beneath it (one class per subclass, importable by name
    from this module so that a pickled model finds it)."""
    if cls not in _SHARDED_CLASSES:
        name = f"VocabParallel{cls.__name__}"
        sharded = type(name, (cls, VocabShardLookup), {"__module__": __name__})
        sharded.__qualname__ = name
        globals()[name] = sharded
        _SHARDED_CLASSES[cls] = sharded
    return _SHARDED_CLASSES[cls]


def _shard_embedding_subclass(module: nn.Embedding, group: str) -> nn.Embedding:
    size, rank = state.get_group_size(group), state.get_group_rank(group)
    start, stop = shard_range(module.num_embeddings, size, rank)
    new = _sharded_class(type(module)).__new__(_sharded_class(type(module)))
    new.__dict__.update(module.__dict__)
    new._parameters, new._buffers, new._modules = dict(module._parameters), dict(module._buffers), dict(module._modules)
    new.__dict__.pop("_shardtorch_shard_specs", None)
    new.group = group
    new._parameters["weight"] = nn.Parameter(module.weight.detach()[start:stop].clone(),
                                             requires_grad=module.weight.requires_grad)
    register_shard(new, "weight", 0, module.num_embeddings, group)
    return new


def vocabulary_parallel(module: nn.Module, group: str) -> nn.Module:
    """This rank's rows of ``module``'s vocabulary: a ParallelEmbedding (dim=0) for an nn.Embedding, the
    subclass itself over a sharded lookup for an nn.Embedding subclass, a ParallelLinear (dim=1) for the
    LM head."""
    if type(module) is nn.Embedding:
        return ParallelEmbedding.from_embedding(module, dim=0, group=group)
    if isinstance(module, nn.Embedding):
        return _shard_embedding_subclass(module, group)
    if isinstance(module, nn.Linear):
        return ParallelLinear.from_linear(module, dim=1, group=group)
    raise ValueError(f"parallelize: style 'vocab' applies to torch.nn.Embedding or torch.nn.Linear, got "
                     f"{type(module).__name__}")


def tie(model: nn.Module, replaced: Dict[int, Tuple[nn.Parameter, nn.Parameter, object]]) -> None:
    """Points every other reference to a replaced parameter (BERT's ``predictions.bias``, the tied
    decoder bias) at its shard, with the same shard facts.
    ``replaced``: {id(old): (old, new, ShardSpec)} (old kept so its id stays its own)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                _, new, spec = replaced[id(param)]
                module._parameters[name] = new
                register_shard(module, name, spec.dim, spec.full_size, spec.group, spec.blocks, spec.unit,
                               spec.parts)
