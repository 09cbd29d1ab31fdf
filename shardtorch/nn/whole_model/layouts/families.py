"""The model families the layouts know, one entry each: the names of their
projections, the attributes their attention keeps its head bookkeeping in,
the class names that tell a layout the names cannot, and the attributes their
forwards follow. The layouts read their names from this table; what they
still test in place is structure, and Hugging Face's general conventions
(``pruned_heads``, a ``gate`` beside a fused projection, the
``variance_epsilon`` of its RMS norms).

To add an architecture: one ``Family`` below (or names added to the entry it
shares them with), and one row in ``tests/distributed/zoo_models.py`` (ZOO),
a tiny model of it that the zoo's tests split at 2 and 3 ranks against the
unsharded model. Recognition stays structural (the sizes and every head
count a module declares must agree, nothing else may hold parameters), and
the proof (proof.py) checks what the names suggest.

The layouts read the union of the entries: a name or attribute of one family
counts on any module that has it (a user's model with Llama's names is split
as Llama). Where one module holds the names of two entries of one kind, the
entry first in the table decides.
"""
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

from torch import nn

from .base import int_attr


@dataclass(frozen=True)
class SeparateQKV:
    """Query, key and value projections of their own, then an output projection."""
    query: str
    key: str
    value: str
    out: str


@dataclass(frozen=True)
class FusedQKV:
    """One projection of query, key and value, then an output projection, laid out ``by`` "part"
    ([query | key | value]) or "head" ([heads, (query, key, value), head_dim]). ``unless``: an attribute that,
    when true, says this module is laid out otherwise."""
    fused: str
    out: str
    by: str
    unless: Optional[str] = None


@dataclass(frozen=True)
class NestedQKV:
    """Query, key and value in the child ``inner``, the output projection ``out`` in the child ``output``
    (BERT); not recognised where ``inner``'s attribute ``unless`` is true."""
    inner: str
    query: str
    key: str
    value: str
    output: str
    out: str
    unless: Optional[str] = None


@dataclass(frozen=True)
class PairMLP:
    """An up projection, then a down projection."""
    up: str
    down: str


@dataclass(frozen=True)
class GatedMLP:
    """Gate and up projections, multiplied, then down."""
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class FusedGatedMLP:
    """One projection [gate | up] (the forward chunks its output in two), then down."""
    gate_up: str
    down: str


@dataclass(frozen=True)
class NestedMLP:
    """``up_module.projection`` then ``down_module.projection``, in a layer that also holds ``beside`` (BERT's
    layer: its ``output`` module is another than its attention's)."""
    up_module: str
    down_module: str
    projection: str
    beside: str


@dataclass(frozen=True)
class ExpertBank:
    """Every expert's MLP in two 3-D parameters of one module: ``gate_up`` [experts, 2 x intermediate,
    width] and ``down`` [experts, width, intermediate]; the rest name the module's attributes that say how
    (transformers 5's experts)."""
    gate_up: str
    down: str
    transposed: str          # both parameters transposed
    concatenated: str        # False: gate and up interleaved, not [gate | up]
    has_gate: str            # must be True
    has_bias: str            # must be False
    post_norm: str           # a norm after each expert: must be False
    intermediate: str        # the intermediate width, set to this rank's


@dataclass(frozen=True)
class HeadAttributes:
    """The attributes an attention module keeps its head bookkeeping in: each one it has must agree with
    its projections' sizes, and is set to this rank's count."""
    counts: Tuple[str, ...] = ()       # query heads
    kv_counts: Tuple[str, ...] = ()    # key/value heads
    groups: Tuple[str, ...] = ()       # query heads per key/value head
    widths: Tuple[str, ...] = ()       # query heads x head_dim
    sizes: Tuple[str, ...] = ()        # head_dim (read, never changed)


@dataclass(frozen=True)
class Family:
    name: str
    models: str
    attention: Tuple[object, ...] = ()
    mlp: Tuple[object, ...] = ()
    experts: Tuple[ExpertBank, ...] = ()
    heads: HeadAttributes = HeadAttributes()
    #: The class names of its attention, where its names alone do not tell the layout: its ``attention``
    #: entries, ``kv_heads`` and ``query_width`` then apply to modules of these classes only.
    classes: Tuple[str, ...] = ()
    kv_heads: Optional[str] = None        # (classes) its key/value head count
    query_width: Optional[str] = None     # (classes) where its forward splits a by-part output: this rank's width
    multi_query: Optional[str] = None     # true: one key and one value head after all query heads (fused by head)
    grouped: Optional[str] = None         # true: [groups, (group's query heads, key, value), head_dim]
    cross_attention: Optional[str] = None  # true: the fused projection holds keys and values only (the query
    #                                        is another projection's)
    #: (split count, switch): the forward slices whole weights itself when the count is above 1 and the
    #: switch is on, so the module is not recognised.
    whole_weight_path: Optional[Tuple[str, str]] = None
    head_tables: Tuple[str, ...] = ()     # own parameters [positions, heads], split by head
    alibi: Optional[str] = None           # the forward's argument of per-head biases for every head
    output_dropout: Optional[str] = None  # part of the name of the dropout on the attention's output


FAMILIES = (
    Family("llama", "Llama, Mistral, Qwen2, Qwen3, Gemma 1-3, OLMo 2, StableLM, Mixtral",
           attention=(SeparateQKV("q_proj", "k_proj", "v_proj", "o_proj"),),
           mlp=(GatedMLP("gate_proj", "up_proj", "down_proj"),),
           heads=HeadAttributes(counts=("num_heads",), kv_counts=("num_key_value_heads",),
                                groups=("num_key_value_groups",), sizes=("head_dim",))),
    Family("opt", "OPT (fc1/fc2 in the decoder layer, beside its attention)",
           attention=(SeparateQKV("q_proj", "k_proj", "v_proj", "out_proj"),),
           mlp=(PairMLP("fc1", "fc2"),),
           heads=HeadAttributes(counts=("num_heads",), sizes=("head_dim",))),
    Family("gptj", "GPT-J",
           attention=(SeparateQKV("q_proj", "k_proj", "v_proj", "out_proj"),),
           mlp=(PairMLP("fc_in", "fc_out"),),
           heads=HeadAttributes(counts=("num_attention_heads",), sizes=("head_dim",))),
    Family("phi", "Phi-1, Phi-2",
           attention=(SeparateQKV("q_proj", "k_proj", "v_proj", "dense"),),
           mlp=(PairMLP("fc1", "fc2"),),
           heads=HeadAttributes(groups=("num_key_value_groups",), sizes=("head_dim",))),
    Family("gpt_neox", "GPT-NeoX",
           attention=(FusedQKV("query_key_value", "dense", by="head"),),
           mlp=(PairMLP("dense_h_to_4h", "dense_4h_to_h"),),
           heads=HeadAttributes(sizes=("head_size",))),
    Family("bloom", "Bloom",
           attention=(FusedQKV("query_key_value", "dense", by="head"),),
           mlp=(PairMLP("dense_h_to_4h", "dense_4h_to_h"),),
           heads=HeadAttributes(counts=("num_heads",), widths=("split_size",), sizes=("head_dim",)),
           whole_weight_path=("pretraining_tp", "slow_but_exact"), alibi="alibi"),
    Family("falcon", "Falcon: by head, multi-query and grouped (new_decoder_architecture)",
           attention=(FusedQKV("query_key_value", "dense", by="head"),),
           mlp=(PairMLP("dense_h_to_4h", "dense_4h_to_h"),),
           heads=HeadAttributes(counts=("num_heads",), kv_counts=("num_kv_heads",), groups=("num_key_value_groups",),
                                widths=("split_size",), sizes=("head_dim",)),
           multi_query="multi_query", grouped="new_decoder_architecture", alibi="alibi"),
    Family("distilbert", "DistilBERT",
           attention=(SeparateQKV("q_lin", "k_lin", "v_lin", "out_lin"),),
           mlp=(PairMLP("lin1", "lin2"),),
           heads=HeadAttributes(counts=("n_heads",), sizes=("attention_head_size",))),
    Family("t5", "T5 and T5 v1.1: self- and cross-attention, a relative position bias by head",
           attention=(SeparateQKV("q", "k", "v", "o"),),
           mlp=(PairMLP("wi", "wo"), GatedMLP("wi_0", "wi_1", "wo")),
           heads=HeadAttributes(counts=("n_heads",), widths=("inner_dim",), sizes=("key_value_proj_dim",))),
    Family("mingpt", "minGPT-style models (their MLP an nn.Sequential, known by its structure)",
           attention=(SeparateQKV("query", "key", "value", "proj"),),
           heads=HeadAttributes(counts=("n_head",))),
    Family("gpt2", "GPT-2",
           attention=(FusedQKV("c_attn", "c_proj", by="part"),),
           mlp=(PairMLP("c_fc", "c_proj"),),
           heads=HeadAttributes(counts=("num_heads",), widths=("split_size",), sizes=("head_dim",)),
           cross_attention="is_cross_attention", output_dropout="resid"),
    # GPT-2's names laid out as GPT-NeoX's; with multi_query, by part as GPT-2's (its one key/value head).
    Family("gpt_bigcode", "GPTBigCode (StarCoder)",
           attention=(FusedQKV("c_attn", "c_proj", by="head", unless="multi_query"),),
           mlp=(PairMLP("c_fc", "c_proj"),),
           heads=HeadAttributes(counts=("num_heads",), groups=("num_key_value_groups",),
                                widths=("inner_dim", "split_size"), sizes=("head_dim",)),
           classes=("GPTBigCodeAttention",), kv_heads="kv_heads", query_width="embed_dim",
           cross_attention="is_cross_attention"),
    Family("timm", "timm's ViT and Swin (a relative position bias table by head)",
           attention=(FusedQKV("qkv", "proj", by="part"),),
           mlp=(PairMLP("fc1", "fc2"),),
           heads=HeadAttributes(counts=("num_heads",), widths=("attn_dim",), sizes=("head_dim",)),
           head_tables=("relative_position_bias_table",), output_dropout="proj"),
    Family("phi3", "Phi-3 (a query part larger than its key/value parts)",
           attention=(FusedQKV("qkv_proj", "o_proj", by="part"),),
           mlp=(FusedGatedMLP("gate_up_proj", "down_proj"),),
           heads=HeadAttributes(kv_counts=("num_key_value_heads",), groups=("num_key_value_groups",),
                                sizes=("head_dim",))),
    Family("bert", "BERT, RoBERTa",
           attention=(NestedQKV("self", "query", "key", "value", "output", "dense", unless="is_decoder"),),
           mlp=(NestedMLP("intermediate", "output", "dense", beside="attention"),),
           heads=HeadAttributes(counts=("num_attention_heads",), widths=("all_head_size",),
                                sizes=("attention_head_size",))),
    Family("moe", "transformers 5's experts: Mixtral, Qwen-MoE, DeepSeek, ...",
           experts=(ExpertBank("gate_up_proj", "down_proj", transposed="is_transposed",
                               concatenated="is_concatenated", has_gate="has_gate", has_bias="has_bias",
                               post_norm="has_post_expert_norm", intermediate="intermediate_dim"),)),
)

#: torch.nn's own attention: its heads are computed inside F.multi_head_attention_forward from the whole
#: in_proj_weight and embed_dim, so no layout applies.
WHOLE_ATTENTION_CLASSES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
#: Words in a class name that mark an attention, or a bank of experts, left whole (left_whole.py).
ATTENTION_CLASS_WORDS = ("Attention", "Attn")
EXPERTS_CLASS_WORD = "Expert"


def _unique(values) -> tuple:
    return tuple(dict.fromkeys(v for v in values if v is not None))


def _entries(field: str, kind: type, families=FAMILIES) -> tuple:
    return _unique(e for f in families for e in getattr(f, field) if isinstance(e, kind))


# The union of the entries, what the layouts read, in table order.
SEPARATE_QKV = _entries("attention", SeparateQKV)
NESTED_QKV = _entries("attention", NestedQKV)
PAIR_MLPS = _entries("mlp", PairMLP)
GATED_MLPS = _entries("mlp", GatedMLP)
FUSED_GATED_MLPS = _entries("mlp", FusedGatedMLP)
NESTED_MLPS = _entries("mlp", NestedMLP)
EXPERT_BANKS = _entries("experts", ExpertBank)
HEAD_COUNTS = _unique(n for f in FAMILIES for n in f.heads.counts)
KV_HEAD_COUNTS = _unique(n for f in FAMILIES for n in f.heads.kv_counts)
GROUP_COUNTS = _unique(n for f in FAMILIES for n in f.heads.groups)
HEAD_WIDTHS = _unique(n for f in FAMILIES for n in f.heads.widths)
HEAD_SIZES = _unique(n for f in FAMILIES for n in f.heads.sizes)
MULTI_QUERY = _unique(f.multi_query for f in FAMILIES)
GROUPED = _unique(f.grouped for f in FAMILIES)
CROSS_ATTENTION = _unique(f.cross_attention for f in FAMILIES)
WHOLE_WEIGHT_PATHS = _unique(f.whole_weight_path for f in FAMILIES)
HEAD_TABLES = _unique(n for f in FAMILIES for n in f.head_tables)
ALIBI = _unique(f.alibi for f in FAMILIES)
OUTPUT_DROPOUT = _unique(f.output_dropout for f in FAMILIES)


def family_of_class(module: nn.Module) -> Optional[Family]:
    """The family that names ``module``'s class among its ``classes``, or None."""
    cls = type(module).__name__
    return next((f for f in FAMILIES if cls in f.classes), None)


def fused_qkv(module: nn.Module, by: str) -> Iterator[FusedQKV]:
    """The fused q/k/v entries laid out ``by`` "part" or "head" that may apply to ``module``: those of its
    class's family (unless its ``unless`` attribute is true), else those of families known by names alone."""
    family = family_of_class(module)
    if family is not None:
        claimed = [e for e in family.attention if isinstance(e, FusedQKV) and not _true(module, e.unless)]
        if claimed:  # names its class lays out its own way: no other entry applies
            yield from (e for e in claimed if e.by == by)
            return
    yield from _unique(e for f in FAMILIES if not f.classes for e in f.attention
                       if isinstance(e, FusedQKV) and e.by == by)


def class_attribute(module: nn.Module, field: str) -> Optional[str]:
    """The attribute ``field`` (``kv_heads``, ``query_width``) of ``module``'s class's family, or None."""
    family = family_of_class(module)
    return getattr(family, field) if family is not None else None


def flagged(module: nn.Module, attributes: Tuple[str, ...]) -> bool:
    """Whether any of the attributes ``attributes`` (MULTI_QUERY, GROUPED, CROSS_ATTENTION) is true on
    ``module``."""
    return any(_true(module, name) for name in attributes)


def reads_whole_weights(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes a path that slices its whole weights itself (Bloom's
    ``slow_but_exact`` with ``pretraining_tp`` above 1): then no layout applies."""
    return any(int_attr(module, count) not in (None, 1) and _true(module, switch)
               for count, switch in WHOLE_WEIGHT_PATHS)


def _true(module: nn.Module, name: Optional[str]) -> bool:
    return name is not None and bool(getattr(module, name, False))
