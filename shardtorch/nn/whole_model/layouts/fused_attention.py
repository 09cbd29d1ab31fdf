"""Attention whose query, key and value come out of one fused projection.

The names are the families' ``FusedQKV`` entries (families.py). Laid out
by part, [query | key | value] (GPT-2's Conv1D ``c_attn``, timm's ``qkv``,
Phi-3's ``qkv_proj``, whose query part is larger than its key/value parts
under grouped-query attention): ``FusedByPart``.

Laid out by head, [heads, (query, key, value), head_dim] (GPT-NeoX's, Bloom's
and Falcon's ``query_key_value``; Megatron's order; GPTBigCode's ``c_attn``
without multi-query, known by its class, as names cannot show a fused
layout): ``FusedByHead``. Falcon's multi-query variant puts its one key and
one value head after all the query heads, and its grouped variant lays out
each key/value group as [its query heads, key, value] (the family's
``multi_query`` and ``grouped`` attributes). GPTBigCode's multi-query
``c_attn`` is by part, of one key/value head, and its forward splits the
output at its ``query_width`` (set to this rank's).

A key/value part with fewer heads than ranks cannot split: its rows lie on
the first ranks (shardtorch.utils.shard_facts, ``parts``) and every rank
sums the group's rows of it at each forward (layers.ColumnProjection,
``gathered``), then uses, for its query heads, the key/value head each reads.
"""

from ....utils.shards import shard_range
from ..layers import ColumnProjection, RowProjection, block_input, is_conv1d
from .base import Fit, int_attr, projection, row
from .families import (CROSS_ATTENTION, GROUP_COUNTS, GROUPED, HEAD_COUNTS, HEAD_TABLES, KV_HEAD_COUNTS, MULTI_QUERY,
                       class_attribute, flagged, fused_qkv, reads_whole_weights)
from .heads import (HeadSplit, HeadsLayout, apply_extras, classify_extras, counts_agree, declared, head_size_of,
                    set_local_counts, slice_alibi_to_local_heads, split_parameter_by_head, takes_alibi)


def _names(m, by: str):
    """(fused, out) of the first FusedQKV entry laid out ``by`` that ``m`` holds, or None."""
    for entry in fused_qkv(m, by):
        if projection(m, entry.fused) is not None and projection(m, entry.out) is not None:
            return entry.fused, entry.out
    return None


def _sizes(m, name):
    proj = getattr(m, name)
    return (proj.nx, proj.nf) if is_conv1d(proj) else (proj.in_features, proj.out_features)


def _counts(m, fused_width: int, parts_per_kv: int):
    """(heads, kv_heads, head_dim) of a fused projection of ``fused_width`` = (heads + 2 kv_heads) x
    head_dim, from what the module declares."""
    heads = next(iter(declared(m, HEAD_COUNTS).values()), None)
    kv_heads = next(iter(declared(m, KV_HEAD_COUNTS).values()), None)
    if kv_heads is None and class_attribute(m, "kv_heads") is not None:
        kv_heads = int_attr(m, class_attribute(m, "kv_heads"))
    groups = next(iter(declared(m, GROUP_COUNTS).values()), None)
    if heads is None and kv_heads is not None and groups is not None:
        heads = kv_heads * groups
    head_dim = head_size_of(m)
    if heads is None:
        if head_dim is None or fused_width % (parts_per_kv * head_dim) != 0:
            return None
        heads = fused_width // (parts_per_kv * head_dim)
    if kv_heads is None:
        kv_heads = heads
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads != 0:
        return None
    if head_dim is None:
        if fused_width % (heads + 2 * kv_heads) != 0:
            return None
        head_dim = fused_width // (heads + 2 * kv_heads)
    if (heads + 2 * kv_heads) * head_dim != fused_width:
        return None
    return heads, kv_heads, head_dim


def _own_tables(m, heads):
    """The module's own parameters: only position bias tables by head are allowed."""
    tables = []
    for name, param in m.named_parameters(recurse=False):
        if name not in HEAD_TABLES or param.dim() != 2 or param.shape[1] != heads:
            return None
        tables.append(name)
    return tables


class _Fused(HeadsLayout):
    def _extras(self, m, names, heads, kv_heads, head_dim):
        tables = _own_tables(m, heads)
        if tables is None:
            return None, None
        extras = classify_extras([(n, c) for n, c in m.named_children() if n not in names], heads, head_dim,
                                 heads * head_dim, kv_heads * head_dim)
        return (tables, extras) if extras is not None else (None, None)

    def _finish(self, m, fit, split, group, size, rank, changed):
        for table in fit.tables:
            split_parameter_by_head(m, table, 1, group, size, rank, split.heads_per_unit)
            changed[table] = "split by head"
        changed.update(apply_extras(m, fit.extras, split, group, size, rank))
        if slice_alibi_to_local_heads(m, split):
            changed["alibi"] = "this rank's heads"
        return changed


def _part_split(heads: int, kv_heads: int, head_dim: int, split: HeadSplit):
    """(parts, gathered, local kv heads, local groups) of a [query | key | value] projection."""
    q, kv = heads * head_dim, kv_heads * head_dim
    if not split.kv_replicated:
        return ((q, split.query_unit), (kv, head_dim), (kv, head_dim)), None, split.local_kv_heads, split.groups
    parts = ((q, head_dim), (kv, head_dim), (kv, head_dim))
    if kv_heads == 1:  # multi-query: the one key/value head, read by every local query head
        return parts, {1: None, 2: None}, 1, split.local_heads
    return parts, {1: split.kv_of_local, 2: split.kv_of_local}, split.local_heads, 1


class FusedByPart(_Fused):
    """[query | key | value] in one projection (GPT-2's c_attn, timm's qkv, Phi-3's qkv_proj)."""

    def fit(self, m):
        names = _names(m, "part")
        # A ``gate`` beside the projections is no part of these layouts.
        if names is None or flagged(m, CROSS_ATTENTION) or getattr(m, "gate", None) is not None:
            return None
        (_, width), (out_in, _) = _sizes(m, names[0]), _sizes(m, names[1])
        counts = _counts(m, width, 3)
        if counts is None:
            return None
        heads, kv_heads, head_dim = counts
        if out_in != heads * head_dim or not counts_agree(m, heads, kv_heads, head_dim):
            return None
        tables, extras = self._extras(m, names, heads, kv_heads, head_dim)
        if tables is None:
            return None
        return Fit(f"fused {names[0]} by part", names=names, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   tables=tables, extras=extras)

    def apply(self, m, fit, group, size, rank, sp=False):
        fused, out = fit.names
        split = HeadSplit(fit.heads, fit.kv_heads, fit.head_dim, size, rank)
        parts, gathered, kv_heads, groups = _part_split(fit.heads, fit.kv_heads, fit.head_dim, split)
        shared = block_input(group, 1, sp)
        if fit.kv_heads == fit.heads and not split.kv_replicated:  # three equal parts of single heads
            setattr(m, fused, ColumnProjection(getattr(m, fused), group, size, rank, shared, blocks=3,
                                               unit=fit.head_dim))
        else:
            setattr(m, fused, ColumnProjection(getattr(m, fused), group, size, rank, shared, parts=parts,
                                               gathered=gathered))
        setattr(m, out, row(sp, getattr(m, out), group, size, rank, unit=split.query_unit))
        changed = set_local_counts(m, split.local_heads, kv_heads, groups, fit.head_dim, fit.heads, fit.kv_heads)
        query_width = class_attribute(m, "query_width")
        if query_width is not None:  # GPTBigCode multi-query splits c_attn's output at it
            setattr(m, query_width, split.local_heads * fit.head_dim)
            changed[query_width] = split.local_heads * fit.head_dim
        if split.kv_replicated:
            changed["key/value"] = "summed whole over the group each forward"
        return self._finish(m, fit, split, group, size, rank, changed)


class FusedByHead(_Fused):
    """[heads, (query, key, value), head_dim] in ``query_key_value`` (GPT-NeoX, Bloom, Falcon) or GPTBigCode's
    ``c_attn``, and Falcon's multi-query and grouped variants."""

    def fit(self, m):
        names = _names(m, "head")
        if names is None or flagged(m, CROSS_ATTENTION):
            return None
        (_, width), (out_in, _) = _sizes(m, names[0]), _sizes(m, names[1])
        if reads_whole_weights(m):
            return None
        grouped, multi_query = flagged(m, GROUPED), flagged(m, MULTI_QUERY)
        counts = _counts(m, width, 3)
        if counts is None:
            return None
        heads, kv_heads, head_dim = counts
        if multi_query and not grouped:
            variant = "multi-query"
            if kv_heads != 1:
                return None
        elif grouped:
            variant = "grouped"
        else:
            variant = "by head"
            if kv_heads != heads:
                return None
        if (heads + 2 * kv_heads) * head_dim != width or out_in != heads * head_dim:
            return None
        if not counts_agree(m, heads, kv_heads, head_dim):
            return None
        tables, extras = self._extras(m, names, heads, kv_heads, head_dim)
        if tables is None:
            return None
        return Fit(f"fused {names[0]} {variant}", geometry=variant, names=names, heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, tables=tables, extras=extras)

    def refusal(self, m, fit, size):
        if fit.geometry == "grouped" and fit.kv_heads < size:
            if fit.heads // fit.kv_heads < size:
                return (f"{fit.kv_heads} key/value groups of {fit.heads // fit.kv_heads} query heads cannot be "
                        f"split over {size} ranks (whole groups need {size} groups, or {size} query heads in each)")
            if fit.tables or fit.extras or takes_alibi(m):
                return (f"with {fit.kv_heads} key/value groups over {size} ranks each rank holds a share of every "
                        f"group's query heads, not a run of heads, which its position biases or norms cannot follow")
        return super().refusal(m, fit, size)

    def apply(self, m, fit, group, size, rank, sp=False):
        fused, out = fit.names
        heads, kv_heads, head_dim = fit.heads, fit.kv_heads, fit.head_dim
        groups = heads // kv_heads
        shared = block_input(group, 1, sp)
        source = getattr(m, fused)
        if fit.geometry == "by head":
            split = HeadSplit(heads, heads, head_dim, size, rank)
            new = ColumnProjection(source, group, size, rank, shared, unit=3 * head_dim)
            local = (split.local_heads, split.local_heads, 1)
        elif fit.geometry == "multi-query":
            split = HeadSplit(heads, 1, head_dim, size, rank)
            parts, gathered, _, _ = _part_split(heads, 1, head_dim, split)
            new = ColumnProjection(source, group, size, rank, shared, parts=parts, gathered=gathered)
            local = (split.local_heads, 1, split.local_heads)
        elif kv_heads >= size:  # grouped, whole groups [query heads, key, value] per rank
            split = HeadSplit(heads, kv_heads, head_dim, size, rank)
            new = ColumnProjection(source, group, size, rank, shared, unit=(groups + 2) * head_dim)
            local = (split.local_heads, split.local_kv_heads, groups)
        else:
            # Grouped, fewer groups than ranks: this rank's share of every group's query heads (not a run of
            # heads: refusal() keeps position biases, norms and ALiBi out), and every group's key and value
            # summed whole over the group at each forward.
            split = None
            start, stop = shard_range(groups, size, rank)
            parts = ((groups * head_dim, head_dim), (head_dim, head_dim), (head_dim, head_dim)) * kv_heads
            new = ColumnProjection(source, group, size, rank, shared, parts=parts,
                                   gathered={i: None for i in range(len(parts)) if i % 3})
            local = ((stop - start) * kv_heads, kv_heads, stop - start)
        setattr(m, fused, new)
        if split is not None:
            setattr(m, out, row(sp, getattr(m, out), group, size, rank, unit=split.query_unit))
        else:  # the attention's output holds this rank's heads of each group, group after group
            setattr(m, out, RowProjection(getattr(m, out), group, size, rank, sequence_dim=1 if sp else None,
                                          parts=((groups * head_dim, head_dim),) * kv_heads))
        changed = set_local_counts(m, local[0], local[1], local[2], head_dim, heads, kv_heads)
        if fit.geometry == "multi-query" or split is None:
            changed["key/value"] = "summed whole over the group each forward"
        return self._finish(m, fit, split, group, size, rank, changed)
