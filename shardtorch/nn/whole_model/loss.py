"""The loss of a parallelized Hugging Face model called with ``labels=``,
computed from the vocabulary shards of its LM head by shardtorch's parallel
cross-entropy; the logits are never gathered.

Which loss is decided from what the model declares, not from its source: an
encoder-decoder (``config.is_encoder_decoder``: T5) scores the decoder's
logits against the labels as they are (its decoder reads the labels shifted
right, which the model builds as without labels); ``loss_type`` ForMaskedLM
(BERT, RoBERTa, DistilBERT) as they are; ``loss_type`` ForCausalLM, or a
decoder-only model that generates (GPT-2's LMHeadModel) shifted by one.

The labels never reach the model's forward: a hook takes them, the forward
runs without them (so no whole-vocabulary torch loss ever sees a shard), and
a hook after it puts the loss first in the output, where Hugging Face puts
it. A mixture of experts' router loss (``aux_loss`` in the output, weighted
by the model's ``router_aux_loss_coef``) is added as the model's own loss
adds it."""
import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...utils.parallel_dim import is_sharded_on_last_dim, register_parallel_dim
from .. import functional as TF
from ..linear import ParallelLinear

_LABELS_ATTR = "_shardtorch_labels"


class VocabParallelLMLoss:
    """Hugging Face's LM losses on the vocabulary shards the parallel LM head
    returns, by shardtorch's parallel cross-entropy: ``shift=True`` is
    ``ForCausalLMLoss`` (the labels shifted by one), ``shift=False`` the
    masked-LM (and encoder-decoder) loss, the labels as they are. Both ignore
    ``ignore_index`` (-100) and sum divided by ``num_items_in_batch`` when
    given, else take the mean. Logits of float16/bfloat16 are upcast to
    float32 as Hugging Face does; float64 stays float64."""

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


#: The name the causal LM loss had first (it serves the masked LM loss too, with shift=False).
VocabParallelCausalLMLoss = VocabParallelLMLoss


def declared_loss(model: nn.Module) -> Optional[str]:
    """"causal", "masked" or "seq2seq" from what the model declares, or None."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    loss_type = getattr(model, "loss_type", None)
    if loss_type == "ForMaskedLM":
        return "masked"
    if loss_type in ("ForCausalLM", "ForConditionalGeneration"):
        return "causal"
    can_generate = getattr(type(model), "can_generate", None)
    if loss_type is None and callable(can_generate) and can_generate():
        return "causal"
    return None


def keep_logits_marked(model: nn.Module, head: ParallelLinear) -> None:
    """Marks the model's output logits as the vocabulary shards they are where its forward computed them
    from the head's output element by element (Gemma 2's final soft-capping, tanh(x / c) x c, makes new
    unmarked tensors): the logits in the output are then known for shards by the parallel losses."""
    local = head.weight.shape[0]

    def hook(_, args, output):
        logits = output[0] if isinstance(output, tuple) else getattr(output, "logits", None)
        if torch.is_tensor(logits) and logits.dim() > 0 and logits.shape[-1] == local and \
                not is_sharded_on_last_dim(logits):
            register_parallel_dim(logits, -1, head.out_features)
    model.register_forward_hook(hook)


def install_loss(model: nn.Module, head: ParallelLinear, group: str) -> Optional[str]:
    """Makes a Hugging Face model called with ``labels=`` compute its loss
    from the sharded logits; returns what was done (None: its forward takes
    no labels)."""
    keep_logits_marked(model, head)
    try:
        parameters = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return None
    if "labels" not in parameters:
        return None
    kind = declared_loss(model)
    names = list(parameters)[1:]  # without self
    if kind is None:
        model.register_forward_pre_hook(_refuse_labels(names), with_kwargs=True)
        return "labels=: refused (no declared LM loss: loss_type is neither ForCausalLM nor ForMaskedLM)"
    loss = VocabParallelLMLoss(head.out_features, group, shift=(kind == "causal"))
    model.register_forward_pre_hook(_take_labels(names, kind), with_kwargs=True)
    model.register_forward_hook(_add_loss(loss), with_kwargs=True, always_call=True)
    what = {"causal": "causal LM loss (labels shifted by one)", "masked": "masked LM loss",
            "seq2seq": "encoder-decoder LM loss (decoder inputs from the labels shifted right)"}[kind]
    return f"labels=: vocabulary-parallel {what}, logits never gathered"


def _labels_of(names, args, kwargs):
    if "labels" in kwargs:
        return kwargs["labels"], args, {k: v for k, v in kwargs.items() if k != "labels"}
    position = names.index("labels")
    if len(args) > position:
        return args[position], args[:position] + (None,) + args[position + 1:], kwargs
    return None, args, kwargs


def _refuse_labels(names):
    def hook(module, args, kwargs):
        if _labels_of(names, args, kwargs)[0] is not None:
            raise ValueError(f"{type(module).__name__}(labels=...): its loss is not a known LM loss, and its own "
                             f"would read the logits' vocabulary shards as whole. Call it without labels= and "
                             f"compute the loss from the sharded logits with ts.nn.ParallelCrossEntropyLoss")
    return hook


def _take_labels(names, kind):
    def hook(module, args, kwargs):
        labels, args, kwargs = _labels_of(names, args, kwargs)
        module.__dict__[_LABELS_ATTR] = None
        if labels is None:
            return None
        extras = {"num_items_in_batch": kwargs.pop("num_items_in_batch", None)}
        if kind == "seq2seq" and kwargs.get("decoder_input_ids") is None and kwargs.get(
                "decoder_inputs_embeds") is None:
            kwargs["decoder_input_ids"] = module.prepare_decoder_input_ids_from_labels(labels=labels)
        module.__dict__[_LABELS_ATTR] = (labels, extras)
        return args, kwargs
    return hook


def _add_loss(loss_function):
    def hook(module, args, kwargs, output):
        taken = module.__dict__.pop(_LABELS_ATTR, None)
        if taken is None or output is None:
            return None
        labels, extras = taken
        logits = output["logits"] if not isinstance(output, tuple) else output[0]
        loss = loss_function(logits, labels, **extras)
        aux_loss = output.get("aux_loss") if not isinstance(output, tuple) else None
        coefficient = getattr(module, "router_aux_loss_coef", None)
        if aux_loss is not None and coefficient is not None:
            loss = loss + coefficient * aux_loss.to(loss.device)
        if isinstance(output, tuple):
            return (loss,) + output
        output["loss"] = loss
        output.move_to_end("loss", last=False)
        return output
    return hook


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
