"""The attention and MLP layouts parallelize knows, one small class each.

A layout recognises a module by its structure (its projections, the
attributes its forward reshapes by, and no other parameters: a per-head norm
or a gate would need more than a pairing, so such variants are not
recognised and stay whole), says why it cannot split over a group (fewer heads
than ranks) and, applied, replaces the projections and adjusts the head
bookkeeping so that the module's own forward computes this rank's heads.

What the zoos' forwards read (transformers 5.x, timm 1.0): GPT-2 splits
``c_attn``'s output by ``split_size`` then views by ``head_dim``; Llama
views by ``head_dim`` and repeats key/value by ``num_key_value_groups``;
BERT views by ``attention_head_size``; timm reshapes by ``num_heads``,
``head_dim`` and ``attn_dim``; minGPT-style models by ``n_head``.
"""
from typing import Dict, List, Optional

from torch import nn

from .layers import ColumnProjection, ReplicatedKeyValue, RowProjection, block_input, is_conv1d

# Modules without parameters that act element by element (allowed between the
# two projections of a Sequential MLP).
_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.Mish, nn.LeakyReLU)


def _own_parameters_only_in(module: nn.Module, names: List[str]) -> bool:
    """Whether every parameter of ``module`` belongs to one of its children ``names``."""
    allowed = {id(p) for name in names for p in getattr(module, name).parameters()}
    return all(id(p) in allowed for p in module.parameters())


def _linear(module: nn.Module, name: str) -> Optional[nn.Linear]:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def _int_attr(module: nn.Module, name: str) -> Optional[int]:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Layout:
    """One known layout: ``kind`` is "attention" or "mlp"."""
    kind = ""
    name = ""

    def matches(self, module: nn.Module) -> bool:
        raise NotImplementedError

    def refusal(self, module: nn.Module, size: int) -> Optional[str]:
        """Why ``module`` cannot split over ``size`` ranks (None: it can)."""
        return None

    def apply(self, module: nn.Module, group: str, size: int, rank: int, sp: bool = False) -> Dict[str, object]:
        """Shards ``module`` in place; returns the attributes it changed (name: new value). ``sp``: sequence
        parallelism (the column projections read the input ``gather_point`` gathered, the row ones
        reduce-scatter)."""
        raise NotImplementedError

    def gather_point(self, module: nn.Module) -> nn.Module:
        """The submodule whose input is gathered along the sequence under sequence parallelism: the one
        whose forward reads the hidden states' shape and feeds the column projections, and not the
        residual (BERT adds it inside its attention and output modules)."""
        return module

    def head_dropout_region(self, module: nn.Module) -> Optional[nn.Module]:
        """The submodule whose forward draws dropout only on this rank's heads
        (to draw from the model-parallel stream), or None where its forward
        may also drop replicated activations, or is not known to."""
        return None


def _row(sp: bool, source: nn.Module, group: str, size: int, rank: int, unit: int = 1) -> RowProjection:
    # Sequence parallelism: reduce-scatter along the sequence (dim 1 of [batch, sequence, features]).
    return RowProjection(source, group, size, rank, unit, sequence_dim=1 if sp else None)


def _too_few(what: str, count: int, size: int) -> Optional[str]:
    if count < size:
        return f"{count} {what} cannot be split over {size} ranks (every rank needs at least one)"
    return None


class GPT2Attention(Layout):
    """Hugging Face GPT-2: fused Conv1D ``c_attn`` [in, 3 x width], ``c_proj``."""
    kind, name = "attention", "gpt2"

    def matches(self, m):
        return (is_conv1d(getattr(m, "c_attn", None)) and is_conv1d(getattr(m, "c_proj", None))
                and not getattr(m, "is_cross_attention", False) and None not in
                (_int_attr(m, "num_heads"), _int_attr(m, "head_dim"), _int_attr(m, "split_size"))
                and m.c_attn.nf == 3 * m.num_heads * m.head_dim and m.split_size == m.num_heads * m.head_dim
                and _own_parameters_only_in(m, ["c_attn", "c_proj"]))

    def refusal(self, m, size):
        return _too_few("attention heads", m.num_heads, size)

    def apply(self, m, group, size, rank, sp=False):
        m.c_attn = ColumnProjection(m.c_attn, group, size, rank, block_input(group, 1, sp), blocks=3, unit=m.head_dim)
        m.c_proj = _row(sp, m.c_proj, group, size, rank, unit=m.head_dim)
        heads = m.c_attn.out_features // (3 * m.head_dim)
        m.num_heads, m.split_size = heads, heads * m.head_dim
        return {"num_heads": m.num_heads, "split_size": m.split_size}

    def head_dropout_region(self, m):
        return m if m.resid_dropout.p == 0 else None


class LlamaAttention(Layout):
    """Hugging Face Llama family: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    grouped-query attention by ``num_key_value_groups``."""
    kind, name = "attention", "llama"

    def matches(self, m):
        if not all(_linear(m, n) is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
        head_dim, groups = _int_attr(m, "head_dim"), _int_attr(m, "num_key_value_groups")
        if head_dim is None or groups is None or head_dim <= 0:
            return False
        q, k = m.q_proj.out_features, m.k_proj.out_features
        return (q % head_dim == 0 and k % head_dim == 0 and m.v_proj.out_features == k and k > 0
                and q == k * groups and m.o_proj.in_features == q
                and _own_parameters_only_in(m, ["q_proj", "k_proj", "v_proj", "o_proj"]))

    def refusal(self, m, size):
        return _too_few("attention heads", m.q_proj.out_features // m.head_dim, size)

    def apply(self, m, group, size, rank, sp=False):
        head_dim, groups = m.head_dim, m.num_key_value_groups
        kv_heads = m.k_proj.out_features // head_dim
        shared = block_input(group, 3, sp)
        if kv_heads >= size:
            # Whole key/value groups per rank: query heads follow their key/value head.
            m.q_proj = ColumnProjection(m.q_proj, group, size, rank, shared, unit=groups * head_dim)
            m.k_proj = ColumnProjection(m.k_proj, group, size, rank, shared, unit=head_dim)
            m.v_proj = ColumnProjection(m.v_proj, group, size, rank, shared, unit=head_dim)
            m.o_proj = _row(sp, m.o_proj, group, size, rank, unit=groups * head_dim)
            return {"num_key_value_groups (unchanged)": groups}
        m.q_proj = ColumnProjection(m.q_proj, group, size, rank, shared, unit=head_dim)
        start = m.q_proj.pieces[0][0] // head_dim
        local = [(start + h) // groups for h in range(m.q_proj.out_features // head_dim)]
        m.k_proj = ReplicatedKeyValue(m.k_proj, group, head_dim, local, shared)
        m.v_proj = ReplicatedKeyValue(m.v_proj, group, head_dim, local, shared)
        m.o_proj = _row(sp, m.o_proj, group, size, rank, unit=head_dim)
        m.num_key_value_groups = 1
        return {"num_key_value_groups": 1, "key/value": "replicated"}

    def head_dropout_region(self, m):
        return m  # attention_dropout, on the attention probabilities only


class BertAttention(Layout):
    """Hugging Face BERT: ``self.query/key/value`` and ``output.dense``."""
    kind, name = "attention", "bert"

    def matches(self, m):
        inner, output = getattr(m, "self", None), getattr(m, "output", None)
        if not isinstance(inner, nn.Module) or output is None or _linear(output, "dense") is None:
            return False
        if not all(_linear(inner, n) is not None for n in ("query", "key", "value")):
            return False
        heads, size = _int_attr(inner, "num_attention_heads"), _int_attr(inner, "attention_head_size")
        return (heads is not None and size is not None and _int_attr(inner, "all_head_size") == heads * size
                and inner.query.out_features == inner.key.out_features == inner.value.out_features == heads * size
                and output.dense.in_features == heads * size and not getattr(inner, "is_decoder", False)
                and _own_parameters_only_in(inner, ["query", "key", "value"]))

    def refusal(self, m, size):
        return _too_few("attention heads", m.self.num_attention_heads, size)

    def gather_point(self, m):
        return m.self

    def head_dropout_region(self, m):
        return m.self  # the attention probabilities' dropout; output.dropout is on replicated activations

    def apply(self, m, group, size, rank, sp=False):
        inner, unit = m.self, m.self.attention_head_size
        shared = block_input(group, 3, sp)
        for name in ("query", "key", "value"):
            setattr(inner, name, ColumnProjection(getattr(inner, name), group, size, rank, shared, unit=unit))
        m.output.dense = _row(sp, m.output.dense, group, size, rank, unit=unit)
        inner.num_attention_heads = inner.query.out_features // unit
        inner.all_head_size = inner.query.out_features
        return {"self.num_attention_heads": inner.num_attention_heads, "self.all_head_size": inner.all_head_size}


class TimmAttention(Layout):
    """timm's ``Attention``: fused ``qkv`` Linear [3 x heads x head_dim, in], ``proj``."""
    kind, name = "attention", "timm"

    def matches(self, m):
        if _linear(m, "qkv") is None or _linear(m, "proj") is None:
            return False
        heads, head_dim, attn_dim = _int_attr(m, "num_heads"), _int_attr(m, "head_dim"), _int_attr(m, "attn_dim")
        return (None not in (heads, head_dim, attn_dim) and attn_dim == heads * head_dim
                and m.qkv.out_features == 3 * attn_dim and m.proj.in_features == attn_dim
                and _own_parameters_only_in(m, ["qkv", "proj"]) and getattr(m, "gate", None) is None)

    def refusal(self, m, size):
        return _too_few("attention heads", m.num_heads, size)

    def apply(self, m, group, size, rank, sp=False):
        m.qkv = ColumnProjection(m.qkv, group, size, rank, block_input(group, 1, sp), blocks=3, unit=m.head_dim)
        m.proj = _row(sp, m.proj, group, size, rank, unit=m.head_dim)
        m.num_heads = m.qkv.out_features // (3 * m.head_dim)
        m.attn_dim = m.num_heads * m.head_dim
        return {"num_heads": m.num_heads, "attn_dim": m.attn_dim}

    def head_dropout_region(self, m):
        return m if m.proj_drop.p == 0 else None


class MinGPTAttention(Layout):
    """minGPT-style (TorchShard's minGPT project): separate ``key``, ``query``,
    ``value`` Linear and ``proj``, heads in ``n_head``. Its forward must reshape
    by ``n_head`` (or -1), not by the input's width (Karpathy's original
    ``C // self.n_head`` reads the whole width and cannot run on a shard)."""
    kind, name = "attention", "mingpt"

    def matches(self, m):
        if not all(_linear(m, n) is not None for n in ("key", "query", "value", "proj")):
            return False
        heads = _int_attr(m, "n_head")
        width = m.query.out_features
        return (heads is not None and heads > 0 and width % heads == 0
                and m.key.out_features == m.value.out_features == width and m.proj.in_features == width
                and _own_parameters_only_in(m, ["key", "query", "value", "proj"]))

    def refusal(self, m, size):
        return _too_few("attention heads", m.n_head, size)

    def apply(self, m, group, size, rank, sp=False):
        unit = m.query.out_features // m.n_head
        shared = block_input(group, 3, sp)
        for name in ("key", "query", "value"):
            setattr(m, name, ColumnProjection(getattr(m, name), group, size, rank, shared, unit=unit))
        m.proj = _row(sp, m.proj, group, size, rank, unit=unit)
        m.n_head = m.query.out_features // unit
        return {"n_head": m.n_head}


class GPT2MLP(Layout):
    """Conv1D ``c_fc`` then ``c_proj`` (GPT-2)."""
    kind, name = "mlp", "gpt2"

    def matches(self, m):
        return (is_conv1d(getattr(m, "c_fc", None)) and is_conv1d(getattr(m, "c_proj", None))
                and m.c_fc.nf == m.c_proj.nx and _own_parameters_only_in(m, ["c_fc", "c_proj"]))

    def refusal(self, m, size):
        return _too_few("hidden features", m.c_fc.nf, size)

    def apply(self, m, group, size, rank, sp=False):
        m.c_fc = ColumnProjection(m.c_fc, group, size, rank, block_input(group, 1, sp))
        m.c_proj = _row(sp, m.c_proj, group, size, rank)
        return {}


class GatedMLP(Layout):
    """``gate_proj`` and ``up_proj`` then ``down_proj`` (Llama family)."""
    kind, name = "mlp", "gated"

    def matches(self, m):
        names = ("gate_proj", "up_proj", "down_proj")
        return (all(_linear(m, n) is not None for n in names)
                and m.gate_proj.out_features == m.up_proj.out_features == m.down_proj.in_features
                and _own_parameters_only_in(m, list(names)))

    def refusal(self, m, size):
        return _too_few("hidden features", m.up_proj.out_features, size)

    def apply(self, m, group, size, rank, sp=False):
        shared = block_input(group, 2, sp)
        m.gate_proj = ColumnProjection(m.gate_proj, group, size, rank, shared)
        m.up_proj = ColumnProjection(m.up_proj, group, size, rank, shared)
        m.down_proj = _row(sp, m.down_proj, group, size, rank)
        return {}


class BertMLP(Layout):
    """BERT's layer: ``intermediate.dense`` then ``output.dense`` (the
    attention's ``output`` is another module)."""
    kind, name = "mlp", "bert"

    def matches(self, m):
        inter, out = getattr(m, "intermediate", None), getattr(m, "output", None)
        if inter is None or out is None or _linear(inter, "dense") is None or _linear(out, "dense") is None:
            return False
        return (hasattr(m, "attention") and inter.dense.out_features == out.dense.in_features
                and _own_parameters_only_in(inter, ["dense"]))

    def refusal(self, m, size):
        return _too_few("hidden features", m.intermediate.dense.out_features, size)

    def gather_point(self, m):
        return m.intermediate

    def apply(self, m, group, size, rank, sp=False):
        m.intermediate.dense = ColumnProjection(m.intermediate.dense, group, size, rank, block_input(group, 1, sp))
        m.output.dense = _row(sp, m.output.dense, group, size, rank)
        return {}


class TimmMlp(Layout):
    """timm's ``Mlp``: ``fc1`` then ``fc2`` (its gated variants chunk ``fc1``'s
    output and are other classes, so they are not recognised)."""
    kind, name = "mlp", "timm"

    def matches(self, m):
        return (type(m).__name__ == "Mlp" and type(m).__module__.startswith("timm.")
                and _linear(m, "fc1") is not None and _linear(m, "fc2") is not None
                and m.fc1.out_features == m.fc2.in_features and _own_parameters_only_in(m, ["fc1", "fc2"]))

    def refusal(self, m, size):
        return _too_few("hidden features", m.fc1.out_features, size)

    def apply(self, m, group, size, rank, sp=False):
        m.fc1 = ColumnProjection(m.fc1, group, size, rank, block_input(group, 1, sp))
        m.fc2 = _row(sp, m.fc2, group, size, rank)
        return {}


class SequentialMLP(Layout):
    """``nn.Sequential(Linear, elementwise..., Linear[, Dropout])`` (minGPT's block MLP)."""
    kind, name = "mlp", "sequential"

    def _pair(self, m):
        if not isinstance(m, nn.Sequential):
            return None
        children = list(m.named_children())
        linears = [i for i, (_, c) in enumerate(children) if isinstance(c, nn.Linear)]
        if len(linears) != 2 or linears[0] != 0:
            return None
        others = [c for i, (_, c) in enumerate(children) if i not in linears]
        if not all(type(c) in _ELEMENTWISE for c in others):
            return None
        first, second = children[linears[0]], children[linears[1]]
        return (first, second) if first[1].out_features == second[1].in_features else None

    def matches(self, m):
        return self._pair(m) is not None

    def refusal(self, m, size):
        return _too_few("hidden features", self._pair(m)[0][1].out_features, size)

    def apply(self, m, group, size, rank, sp=False):
        (up_name, up), (down_name, down) = self._pair(m)
        m._modules[up_name] = ColumnProjection(up, group, size, rank, block_input(group, 1, sp))
        m._modules[down_name] = _row(sp, down, group, size, rank)
        return {}


ATTENTION_LAYOUTS = [GPT2Attention(), LlamaAttention(), BertAttention(), TimmAttention(), MinGPTAttention()]
MLP_LAYOUTS = [GPT2MLP(), GatedMLP(), BertMLP(), TimmMlp(), SequentialMLP()]


def find_layout(module: nn.Module, kind: Optional[str] = None) -> Optional[Layout]:
    """The known layout ``module`` has (of ``kind`` if given), or None."""
    for layout in ATTENTION_LAYOUTS + MLP_LAYOUTS:
        if (kind is None or layout.kind == kind) and layout.matches(module):
            return layout
    return None
