"""Attention with separate query, key and value projections.

``SeparateAttention`` recognises the projections by the names of the
families' ``SeparateQKV`` entries (families.py: Llama and its kin, OPT,
GPT-J, Phi, DistilBERT, T5's self- and cross-attention, minGPT) and the head
geometry by the projections' sizes and the head bookkeeping the module
declares (heads.py). Beside the projections it accepts norms per head, RMS
norms over a whole projection and a relative position bias by head; any
other parameter makes it unknown (left whole).

BERT keeps its query/key/value in ``self`` and the output projection in
``output`` (a ``NestedQKV`` entry): ``BertAttention``.
"""

from torch import nn

from ..layers import ColumnProjection, ReplicatedKeyValue, block_input
from .base import Fit, Layout, int_attr, linear, own_parameters_only_in, row, too_few
from .families import FAMILIES, GROUP_COUNTS, HEAD_COUNTS, KV_HEAD_COUNTS, SEPARATE_QKV, NestedQKV
from .heads import (HeadSplit, HeadsLayout, apply_extras, classify_extras, counts_agree, declared, head_size_of,
                    set_local_counts, slice_alibi_to_local_heads)


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


class SeparateAttention(HeadsLayout):
    def fit(self, m):
        for entry in SEPARATE_QKV:
            q_name, k_name, v_name, out_name = entry.query, entry.key, entry.value, entry.out
            q, k, v, out = linear(m, q_name), linear(m, k_name), linear(m, v_name), linear(m, out_name)
            if q is None or k is None or v is None or out is None:
                continue
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


class BertAttention(Layout):
    """Hugging Face BERT (RoBERTa, ...): ``self.query/key/value`` and ``output.dense`` (a ``NestedQKV``
    entry), its head bookkeeping in its family's attributes."""
    kind = "attention"

    def fit(self, m):
        for family in FAMILIES:
            for entry in family.attention:
                if isinstance(entry, NestedQKV):
                    fit = _nested_fit(m, entry, family.heads)
                    if fit is not None:
                        return fit
        return None

    def refusal(self, m, fit, size):
        return too_few("attention heads", fit.heads, size)

    def gather_point(self, m, fit):
        return getattr(m, fit.entry.inner)

    def head_dropout_region(self, m, fit):
        # the attention probabilities' dropout; the output module's dropout is on replicated activations
        return getattr(m, fit.entry.inner)

    def apply(self, m, fit, group, size, rank, sp=False):
        entry, unit = fit.entry, fit.head_dim
        inner, output = getattr(m, entry.inner), getattr(m, entry.output)
        shared = block_input(group, 3, sp)
        for name in (entry.query, entry.key, entry.value):
            setattr(inner, name, ColumnProjection(getattr(inner, name), group, size, rank, shared, unit=unit))
        setattr(output, entry.out, row(sp, getattr(output, entry.out), group, size, rank, unit=unit))
        width = getattr(inner, entry.query).out_features
        setattr(inner, fit.count, width // unit)
        setattr(inner, fit.width, width)
        return {f"{entry.inner}.{fit.count}": width // unit, f"{entry.inner}.{fit.width}": width}


def _nested_fit(m, entry: NestedQKV, heads_attributes):
    inner, output = getattr(m, entry.inner, None), getattr(m, entry.output, None)
    if not isinstance(inner, nn.Module) or output is None or linear(output, entry.out) is None:
        return None
    names = (entry.query, entry.key, entry.value)
    if not all(linear(inner, n) is not None for n in names):
        return None
    count, width, size_name = heads_attributes.counts[0], heads_attributes.widths[0], heads_attributes.sizes[0]
    heads, size = int_attr(inner, count), int_attr(inner, size_name)
    q, k, v = (getattr(inner, n) for n in names)
    if not (heads is not None and size is not None and int_attr(inner, width) == heads * size
            and q.out_features == k.out_features == v.out_features == heads * size
            and getattr(output, entry.out).in_features == heads * size
            and not (entry.unless and getattr(inner, entry.unless, False))
            and own_parameters_only_in(inner, list(names))):
        return None
    return Fit("bert", heads=heads, head_dim=size, entry=entry, count=count, width=width)
