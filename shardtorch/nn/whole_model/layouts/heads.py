"""Splitting attention by whole heads: which heads a rank holds, the head
bookkeeping the module's own forward reads, and what beside the projections
follows the heads (per-head norms, norms over a whole projection, relative
position biases, ALiBi slopes).

The head-count attributes the zoos' forwards reshape by, or pass on to the
attention functions (each family's, families.py), are set to this rank's
counts where the module has them. Some forwards read the counts from the module's ``config`` (Phi-3
slices its fused projection at ``config.num_attention_heads x head_dim``):
that module gets a view of its config with its local counts, which reads
everything else from the shared config, so changes to the model's config
(the attention implementation) still reach it.
"""
import inspect
from typing import Dict, List, Optional

import torch
from torch import nn

from ....utils.shard_facts import register_shard, split_pieces
from ....utils.shards import shard_range
from ..layers import _rows
from ..norms import HeadShardedRMSNorm, sum_gradients_over_group
from .base import Layout, int_attr, too_few
from .families import (ALIBI, GROUP_COUNTS, HEAD_COUNTS, HEAD_SIZES, HEAD_WIDTHS, KV_HEAD_COUNTS,
                       OUTPUT_DROPOUT)


class HeadSplit:
    """Which heads this rank holds of ``heads`` query heads and ``kv_heads``
    key/value heads of ``head_dim`` features.

    With at least as many key/value heads as ranks, whole key/value groups
    split (each rank's query heads are those of its key/value heads: the
    query unit is a group). With fewer, the query heads split one by one and
    the key/value heads are not split: ``kv_replicated``, and ``kv_of_local``
    lists the key/value head of each local query head."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, size: int, rank: int) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.groups = heads // kv_heads
        self.kv_replicated = kv_heads < size
        if self.kv_replicated:
            self.query_unit = head_dim
            start, stop = shard_range(heads, size, rank)
            self.local_heads, self.first_head = stop - start, start
            self.kv_of_local = [h // self.groups for h in range(start, stop)]
            self.local_kv_heads = None
        else:
            self.query_unit = self.groups * head_dim
            start, stop = shard_range(kv_heads, size, rank)
            self.local_kv_heads = stop - start
            self.local_heads, self.first_head = self.local_kv_heads * self.groups, start * self.groups
            self.kv_of_local = None

    @property
    def heads_per_unit(self) -> int:
        return self.query_unit // self.head_dim


def head_size_of(module: nn.Module) -> Optional[int]:
    for name in HEAD_SIZES:
        value = int_attr(module, name)
        if value is not None and value > 0:
            return value
    return None


def declared(module, names) -> Dict[str, int]:
    """{attribute: value} of the int attributes ``names`` that ``module`` has."""
    return {name: int_attr(module, name) for name in names if int_attr(module, name) is not None}


def counts_agree(module: nn.Module, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether every head-count attribute the module declares agrees with the projections' sizes."""
    return (all(v == heads for v in declared(module, HEAD_COUNTS).values())
            and all(v == kv_heads for v in declared(module, KV_HEAD_COUNTS).values())
            and all(v == heads // kv_heads for v in declared(module, GROUP_COUNTS).values())
            and all(v == heads * head_dim for v in declared(module, HEAD_WIDTHS).values()))


def set_local_counts(module: nn.Module, heads: int, kv_heads: int, groups: int, head_dim: int,
                     whole_heads: int, whole_kv_heads: int) -> Dict[str, object]:
    """Sets the head bookkeeping the module declares to this rank's counts; returns what changed."""
    changed = {}
    for names, value in ((HEAD_COUNTS, heads), (KV_HEAD_COUNTS, kv_heads), (GROUP_COUNTS, groups),
                         (HEAD_WIDTHS, heads * head_dim)):
        for name in declared(module, names):
            setattr(module, name, value)
            changed[name] = value
    config = getattr(module, "config", None)
    overrides = {name: value for names, whole, value in ((HEAD_COUNTS, whole_heads, heads),
                                                         (KV_HEAD_COUNTS, whole_kv_heads, kv_heads))
                 for name in names if int_attr(config, name) == whole}
    if config is not None and overrides:
        module.config = LocalHeadsConfig(config, overrides)
        changed.update({f"config.{name}": value for name, value in overrides.items()})
    return changed


class LocalHeadsConfig:
    """A module's view of the model's config with this rank's head counts:
    every other attribute is read from (and written to) the shared config."""

    def __init__(self, config, overrides: Dict[str, int]) -> None:
        object.__setattr__(self, "_shared", config)
        object.__setattr__(self, "_local", dict(overrides))

    def __getattr__(self, name):
        # Reached only when the instance and its class lack ``name``. ``self.__dict__`` (found on the class, so no
        # recursion), not object.__getattribute__, which torch.compile cannot trace: it broke the graph in
        # every attention that reads its config (Llama's, each forward).
        state = self.__dict__
        if name in ("_shared", "_local") or "_shared" not in state:
            raise AttributeError(name)
        if name in state["_local"]:
            return state["_local"][name]
        return getattr(state["_shared"], name)

    def __setattr__(self, name, value):
        if name in self._local:
            self._local[name] = value
        else:
            setattr(self._shared, name, value)

    def __repr__(self) -> str:
        return f"LocalHeadsConfig({self._local}, of {type(self._shared).__name__})"


class HeadsLayout(Layout):
    """What the attention layouts that split by heads share: the same refusal and dropout region."""
    kind = "attention"

    def refusal(self, module, fit, size):
        reason = too_few("attention heads", fit.heads, size)
        if reason is None:
            reason = extras_refusal(fit.extras, HeadSplit(fit.heads, fit.kv_heads, fit.head_dim, size, 0))
        return reason

    def head_dropout_region(self, module, fit):
        return module if output_dropout_is_off(module) else None


def output_dropout_is_off(module: nn.Module) -> bool:
    """Whether no nn.Dropout child that drops the attention's output (its name holding one of the families'
    OUTPUT_DROPOUT: GPT-2's resid_dropout, timm's proj_drop) is on: then the module's dropout acts on its
    heads only (the attention probabilities)."""
    return all(child.p == 0 for name, child in module.named_children()
               if isinstance(child, nn.Dropout) and any(part in name for part in OUTPUT_DROPOUT))


# What may sit beside the projections of an attention module, following its heads.

def is_per_head_norm(child: nn.Module, head_dim: int) -> bool:
    """A norm over each head's features, the same for every head (Qwen3's, Gemma 3's q_norm/k_norm): its own
    parameters are head_dim long, so they stay whole. A norm per head kept in a list of norms (StableLM's
    q_layernorm) is not one: its forward pairs the heads it gets with the first norms of its list."""
    params = list(child.parameters())
    return (bool(params) and len(params) == len(list(child.parameters(recurse=False)))
            and all(p.dim() == 1 and p.shape[0] == head_dim for p in params))


def is_projection_rms_norm(child: nn.Module, width: int) -> bool:
    """An RMS norm over a whole projection's output (OLMo 2's q_norm/k_norm): one ``weight`` of ``width``
    and the ``variance_epsilon`` of transformers' RMSNorm that multiplies by its weight."""
    params = dict(child.named_parameters())
    return (set(params) == {"weight"} and params["weight"].dim() == 1 and params["weight"].shape[0] == width
            and isinstance(getattr(child, "variance_epsilon", None), float) and not list(child.children()))


def is_relative_position_bias(child: nn.Module, heads: int) -> bool:
    """T5's relative_attention_bias: an nn.Embedding of [buckets, heads]."""
    return type(child) is nn.Embedding and child.embedding_dim == heads and child.max_norm is None


def classify_extras(children, heads: int, head_dim: int, q_width: int, kv_width: int) -> Optional[Dict[str, str]]:
    """{child name: "head norm" | "query norm" | "key norm" | "position bias"} for the (name, child) pairs
    ``children`` with parameters (those beside an attention's projections), or None when one of them is
    none of these (then the module is not recognised)."""
    extras = {}
    for name, child in children:
        if not any(True for _ in child.parameters()):
            continue
        if is_per_head_norm(child, head_dim):
            extras[name] = "head norm"
        elif is_projection_rms_norm(child, q_width):
            extras[name] = "query norm"
        elif is_projection_rms_norm(child, kv_width):
            extras[name] = "key norm"
        elif is_relative_position_bias(child, heads):
            extras[name] = "position bias"
        else:
            return None
    return extras


def extras_refusal(extras: Dict[str, str], split: HeadSplit) -> Optional[str]:
    if split.kv_replicated and "key norm" in extras.values():
        return (f"{split.kv_heads} key/value heads cannot be split over more ranks, and the key norm spans all "
                f"of them, which a rank holding copies of some cannot compute")
    return None


def apply_extras(module: nn.Module, extras: Dict[str, str], split: HeadSplit, group: str, size: int,
                 rank: int) -> Dict[str, object]:
    """Splits or keeps what follows the heads; returns notes for the report."""
    notes = {}
    for name, kind in extras.items():
        child = getattr(module, name)
        if kind == "head norm":
            sum_gradients_over_group(child, group)
            notes[name] = "whole (per head), gradient summed over the group"
        elif kind in ("query norm", "key norm"):
            unit = split.query_unit if kind == "query norm" else split.head_dim
            setattr(module, name, HeadShardedRMSNorm(child, group, size, rank, unit))
            notes[name] = "split with the heads, sum of squares over the group"
        else:
            setattr(module, name, head_columns(child, group, size, rank, split.heads_per_unit))
            notes[name] = "split by head"
    return notes


def head_columns(embedding: nn.Embedding, group: str, size: int, rank: int, unit: int) -> nn.Embedding:
    """An nn.Embedding [rows, heads] cut to this rank's heads' columns (T5's relative position bias), the
    heads taken ``unit`` at a time as the query heads are."""
    pieces = split_pieces(embedding.embedding_dim, size, rank, 1, unit)
    weight = _rows(embedding.weight, 1, pieces)
    local = nn.Embedding(embedding.num_embeddings, weight.shape[1], embedding.padding_idx,
                         device="meta", dtype=weight.dtype)
    local.weight = nn.Parameter(weight, requires_grad=embedding.weight.requires_grad)
    local.train(embedding.training)
    register_shard(local, "weight", 1, embedding.embedding_dim, group, 1, unit)
    return local


def split_parameter_by_head(module: nn.Module, name: str, dim: int, group: str, size: int, rank: int,
                            unit: int = 1) -> None:
    """Replaces ``module``'s own parameter ``name`` by this rank's heads along ``dim`` (Swin's relative
    position bias table [positions, heads])."""
    param = module._parameters[name]
    pieces = split_pieces(param.shape[dim], size, rank, 1, unit)
    module._parameters[name] = nn.Parameter(_rows(param, dim, pieces), requires_grad=param.requires_grad)
    register_shard(module, name, dim, param.shape[dim], group, 1, unit)


def _forward_parameters(module: nn.Module) -> List[str]:
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _alibi_argument(module: nn.Module) -> Optional[str]:
    parameters = _forward_parameters(module)
    return next((name for name in ALIBI if name in parameters), None)


def takes_alibi(module: nn.Module) -> bool:
    return _alibi_argument(module) is not None


def slice_alibi_to_local_heads(module: nn.Module, split: HeadSplit) -> bool:
    """A forward taking ``alibi`` (Bloom's, [batch x heads, 1, keys], built by the model for every head)
    gets this rank's heads' rows of it (a contiguous run of heads); returns whether it takes one."""
    argument = _alibi_argument(module)
    if argument is None:
        return False
    position = _forward_parameters(module).index(argument)
    heads, first, local = split.heads, split.first_head, split.local_heads

    def local_rows(alibi: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(alibi) or alibi.shape[0] % heads != 0:
            return alibi
        per_head = alibi.view(alibi.shape[0] // heads, heads, *alibi.shape[1:])
        return per_head[:, first:first + local].reshape(-1, *alibi.shape[1:])

    def hook(_, args, kwargs):
        if argument in kwargs:
            return args, dict(kwargs, **{argument: local_rows(kwargs[argument])})
        if len(args) > position:
            args = args[:position] + (local_rows(args[position]),) + args[position + 1:]
        return args, kwargs
    module.register_forward_pre_hook(hook, with_kwargs=True)
    return True
