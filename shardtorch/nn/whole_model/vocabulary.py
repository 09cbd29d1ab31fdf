"""The vocabulary end of a model: the token embedding and the LM head split
by vocabulary rows, the logits left sharded (marked), and the loss computed
from the shards by shardtorch's parallel cross-entropy, never gathered."""
import inspect
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...utils.parallel_dim import is_sharded_on_last_dim
from .. import functional as TF
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


def vocabulary_parallel(module: nn.Module, group: str) -> nn.Module:
    """The ParallelEmbedding (dim=0) or ParallelLinear (dim=1) holding this
    rank's rows of ``module``'s vocabulary."""
    if type(module) is nn.Embedding:
        return ParallelEmbedding.from_embedding(module, dim=0, group=group)
    if type(module) is nn.Linear:
        return ParallelLinear.from_linear(module, dim=1, group=group)
    raise ValueError(f"parallelize: style 'vocab' applies to torch.nn.Embedding or torch.nn.Linear, got "
                     f"{type(module).__name__}")


class VocabParallelCausalLMLoss:
    """Hugging Face's ``ForCausalLMLoss`` (shift the labels by one, ignore_index
    -100, sum divided by ``num_items_in_batch`` when given, else the mean) on
    the vocabulary shards the parallel LM head returns, by shardtorch's
    parallel cross-entropy. Logits of float16/bfloat16 are upcast to float32
    as Hugging Face does; float64 stays float64."""

    def __init__(self, vocab_size: int, group: str, shift: bool = True) -> None:
        self.vocab_size, self.group, self.shift = vocab_size, group, shift

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None,
                 num_items_in_batch=None, ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None,
                 **kwargs) -> torch.Tensor:
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(f"parallelize's LM loss: vocab_size must be the LM head's {self.vocab_size}, "
                             f"got {vocab_size}")
        if not is_sharded_on_last_dim(logits):
            raise ValueError("parallelize's LM loss: logits must be the vocabulary shards of the parallel LM head "
                             f"(marked parallel_dim -1), got an unmarked tensor of shape {tuple(logits.shape)}")
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if shift_labels is None:
            shift_labels = labels
            if self.shift:
                shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = TF.parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=ignore_index,
                                         reduction=reduction, parallel=True, group=self.group,
                                         num_classes=self.vocab_size)
        if reduction == "sum":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def _refuse_labels(model: nn.Module, reason: str):
    def hook(module, args, kwargs):
        if kwargs.get("labels") is not None:
            raise ValueError(f"{type(module).__name__}(labels=...): {reason}. Call it without labels= and compute "
                             f"the loss from the sharded logits with ts.nn.ParallelCrossEntropyLoss (or "
                             f"ts.nn.causal_lm_loss for a causal LM)")
    return model.register_forward_pre_hook(hook, with_kwargs=True)


def install_loss(model: nn.Module, head: ParallelLinear, group: str) -> Optional[str]:
    """Makes a Hugging Face model called with ``labels=`` compute its loss
    from the sharded logits; returns what was done (None: not a Hugging Face
    model with labels)."""
    forward = type(model).forward
    try:
        takes_labels = "labels" in inspect.signature(forward).parameters
        source = inspect.getsource(forward)
    except (TypeError, ValueError, OSError):
        return None
    if not takes_labels or not hasattr(type(model), "loss_function"):
        return None
    loss_type = getattr(model, "loss_type", None)
    causal = loss_type == "ForCausalLM" or (loss_type is None and type(model).__name__.endswith(
        ("LMHeadModel", "ForCausalLM")))
    masked = loss_type == "ForMaskedLM"
    if "self.loss_function(" in source and (causal or masked):
        model.loss_function = VocabParallelCausalLMLoss(head.out_features, group, shift=causal)
        return f"labels=: vocabulary-parallel {'causal' if causal else 'masked'} LM loss (logits never gathered)"
    _refuse_labels(model, "its forward computes the loss with a whole-vocabulary torch loss, which cannot read "
                          "the logits' vocabulary shards")
    return "labels=: refused (the model's own loss needs whole logits)"


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, fused: bool = False,
                   ignore_index: int = -100, **backbone_kwargs) -> torch.Tensor:
    """The causal LM loss of a parallelized Hugging Face model (labels shifted
    by one, ``ignore_index`` ignored, mean over the rest), computed from the
    backbone's last hidden state. ``fused=True``: by the LM head's
    ``linear_cross_entropy``, which never forms the [tokens, vocabulary]
    logits, not even their shard; ``fused=False``: the head's sharded logits
    and the parallel cross-entropy. ``backbone_kwargs`` (attention_mask, ...)
    go to ``model.base_model``."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(head, ParallelLinear) or head.dim not in (1, -1):
        raise ValueError(f"causal_lm_loss: model's output embeddings must be a vocabulary-parallel ParallelLinear "
                         f"(run ts.nn.parallelize first), got {type(head).__name__}")
    outputs = model.base_model(input_ids=input_ids, **backbone_kwargs)
    hidden = outputs[0]
    target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1).to(hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if fused:
        return head.linear_cross_entropy(hidden, target, ignore_index=ignore_index)
    return TF.parallel_cross_entropy(head(hidden), target, ignore_index=ignore_index, parallel=True,
                                     group=head.group, num_classes=head.out_features)


def tie(model: nn.Module, replaced: Dict[int, Tuple[nn.Parameter, nn.Parameter, object]]) -> None:
    """Points every other reference to a replaced parameter (a tied LM head,
    BERT's ``predictions.bias``) at its shard, with the same shard facts.
    ``replaced``: {id(old): (old, new, ShardSpec)} (old kept so its id stays its own)."""
    from ...utils.shard_facts import register_shard
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                _, new, spec = replaced[id(param)]
                module._parameters[name] = new
                register_shard(module, name, spec.dim, spec.full_size, spec.group, spec.blocks, spec.unit)

