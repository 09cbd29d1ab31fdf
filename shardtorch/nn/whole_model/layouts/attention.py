"""Attention with separate query, key and value projections.

``SeparateAttention`` recognises the projections by their names
(``q_proj/k_proj/v_proj`` then ``o_proj``, ``out_proj`` or ``dense``: the
Llama family, Mistral, Qwen2/3, Gemma 1-3, OLMo 2, StableLM, Mixtral, OPT,
GPT-J; ``q_lin/k_lin/v_lin/out_lin``: DistilBERT; ``q/k/v/o``: T5, self- and
cross-attention; ``query/key/value/proj``: minGPT) and the head geometry by
the projections' sizes and the head bookkeeping the module declares
(heads.py). Beside the projections it accepts norms per head, RMS
norms over a whole projection and a relative position bias by head; any
other parameter makes it unknown (left whole).

BERT keeps its query/key/value in ``self`` and the output projection in
``output``: ``BertAttention``.
"""

from torch import nn

from ..layers import ColumnProjection, ReplicatedKeyValue, block_input
from .base import Fit, Layout, int_attr, linear, output_dropout_is_off, own_parameters_only_in, row, too_few
from .heads import (GROUP_COUNTS, HEAD_COUNTS, KV_HEAD_COUNTS, HeadSplit, apply_extras, classify_extras,
                    counts_agree, declared, extras_refusal, head_size_of, set_local_counts,
                    slice_alibi_to_local_heads)

_NAMES = (("q_proj", "k_proj", "v_proj", ("o_proj", "out_proj", "dense")),
          ("q_lin", "k_lin", "v_lin", ("out_lin",)),
          ("q", "k", "v", ("o",)),
          ("query", "key", "value", ("proj",)))


def _head_geometry(module: nn.Module, q_width: int, kv_width: int):
    """(heads, key/value heads, head_dim) from the declared head size or head counts, or None."""
    head_dim = head_size_of(module)
    if head_dim is None:
        counts = list(declared(module, HEAD_COUNTS).values())
        if not counts or counts[0] <= 0 or q_width % counts[0] != 0:
            return None
        head_dim = q_width // counts[0]
    if q_width % head_dim != 0 or kv_width % head_dim != 0 or kv_width == 0:
        return None
    heads, kv_heads = q_width // head_dim, kv_width // head_dim
    if heads % kv_heads != 0 or not counts_agree(module, heads, kv_heads, head_dim):
        return None
    if kv_heads != heads and not declared(module, KV_HEAD_COUNTS) and not declared(module, GROUP_COUNTS):
        return None  # fewer key/value heads than query heads, and no attribute says how they are shared
    return heads, kv_heads, head_dim


class SeparateAttention(Layout):
    kind = "attention"

    def fit(self, m):
        for q_name, k_name, v_name, out_names in _NAMES:
            q, k, v = linear(m, q_name), linear(m, k_name), linear(m, v_name)
            out_name = next((n for n in out_names if linear(m, n) is not None), None)
            if q is None or k is None or v is None or out_name is None:
                continue
            out = linear(m, out_name)
            if (v.out_features != k.out_features or out.in_features != q.out_features
                    or not q.in_features == k.in_features == v.in_features or getattr(m, "pruned_heads", None)):
                return None
            geometry = _head_geometry(m, q.out_features, k.out_features)
            if geometry is None:
                return None
            heads, kv_heads, head_dim = geometry
            if any(True for _ in m.parameters(recurse=False)):
                return None
            names = (q_name, k_name, v_name, out_name)
            extras = classify_extras([(n, c) for n, c in m.named_children() if n not in names], heads, head_dim,
                                     q.out_features, k.out_features)
            if extras is None:
                return None
            return Fit("/".join(names), names=names,
                       heads=heads, kv_heads=kv_heads, head_dim=head_dim, extras=extras)
        return None

    def refusal(self, m, fit, size):
        reason = too_few("attention heads", fit.heads, size)
        if reason is None:
            reason = extras_refusal(fit.extras, HeadSplit(fit.heads, fit.kv_heads, fit.head_dim, size, 0))
        return reason

    def apply(self, m, fit, group, size, rank, sp=False):
        q_name, k_name, v_name, out_name = fit.names
        split = HeadSplit(fit.heads, fit.kv_heads, fit.head_dim, size, rank)
        shared = block_input(group, 3, sp)
        setattr(m, q_name, ColumnProjection(getattr(m, q_name), group, size, rank, shared, unit=split.query_unit))
        if split.kv_replicated:
            for name in (k_name, v_name):
                setattr(m, name, ReplicatedKeyValue(getattr(m, name), group, fit.head_dim, split.kv_of_local,
                                                    shared))
            kv_heads, groups = split.local_heads, 1
        else:
            for name in (k_name, v_name):
                setattr(m, name, ColumnProjection(getattr(m, name), group, size, rank, shared, unit=fit.head_dim))
            kv_heads, groups = split.local_kv_heads, split.groups
        setattr(m, out_name, row(sp, getattr(m, out_name), group, size, rank, unit=split.query_unit))
        changed = set_local_counts(m, split.local_heads, kv_heads, groups, fit.head_dim, fit.heads, fit.kv_heads)
        if split.kv_replicated:
            changed["key/value"] = "replicated"
        changed.update(apply_extras(m, fit.extras, split, group, size, rank))
        if slice_alibi_to_local_heads(m, split):
            changed["alibi"] = "this rank's heads"
        return changed

    def head_dropout_region(self, m, fit):
        return m if output_dropout_is_off(m) else None


class BertAttention(Layout):
    """Hugging Face BERT (RoBERTa, ...): ``self.query/key/value`` and ``output.dense``."""
    kind = "attention"

    def fit(self, m):
        inner, output = getattr(m, "self", None), getattr(m, "output", None)
        if not isinstance(inner, nn.Module) or output is None or linear(output, "dense") is None:
            return None
        if not all(linear(inner, n) is not None for n in ("query", "key", "value")):
            return None
        heads, size = int_attr(inner, "num_attention_heads"), int_attr(inner, "attention_head_size")
        if not (heads is not None and size is not None and int_attr(inner, "all_head_size") == heads * size
                and inner.query.out_features == inner.key.out_features == inner.value.out_features == heads * size
                and output.dense.in_features == heads * size and not getattr(inner, "is_decoder", False)
                and own_parameters_only_in(inner, ["query", "key", "value"])):
            return None
        return Fit("bert", heads=heads, head_dim=size)

    def refusal(self, m, fit, size):
        return too_few("attention heads", fit.heads, size)

    def gather_point(self, m, fit):
        return m.self

    def head_dropout_region(self, m, fit):
        return m.self  # the attention probabilities' dropout; output.dropout is on replicated activations

    def apply(self, m, fit, group, size, rank, sp=False):
        inner, unit = m.self, fit.head_dim
        shared = block_input(group, 3, sp)
        for name in ("query", "key", "value"):
            setattr(inner, name, ColumnProjection(getattr(inner, name), group, size, rank, shared, unit=unit))
        m.output.dense = row(sp, m.output.dense, group, size, rank, unit=unit)
        inner.num_attention_heads = inner.query.out_features // unit
        inner.all_head_size = inner.query.out_features
        return {"self.num_attention_heads": inner.num_attention_heads, "self.all_head_size": inner.all_head_size}
