"""peft's LoRA layer around shardtorch's projections, the adapter split to match its base.

- Column-parallel base (ColumnProjection, fused parts included): lora_A whole, lora_B split by the
  base's output rows (the same pieces as the base's weight, so a fused q/k/v or gate/up projection
  gets exactly its parts' rows). lora_A's gradient on a rank covers its output rows only, so lora_A
  passes through ``copy`` (its gradient summed over the group in backward). The adapter reads the
  input the base read (the block's shared copy), so the input's gradient is summed once for both.
- Replicated key/value projection (ReplicatedKeyValue, fewer key/value heads than ranks): both
  factors whole, lora_B's rows taken per local query head as the base takes its weight's.
- Row-parallel base (RowProjection): lora_A split by the base's input features, lora_B whole (its
  gradient summed over the group); the adapter's share of the output joins the base's before the
  row projection's one all-reduce, so the adapter adds no collective forward.

The classes are peft's own ``lora.Linear`` with another forward and split factors: peft's merge,
unmerge, adapter switching and state dict work unchanged (a factor's delta is this rank's slice of
the base weight's). peft itself is never patched; it finds them through a LoraConfig's custom module
mapping (``lora.lora_config``), or ``parallelize`` converts the LoRA layers of a PeftModel.
"""
import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from ...distributed import mappings
from ...utils.shard_facts import register_shard
from .layers import ColumnProjection, ReplicatedKeyValue, RowProjection, _rows

#: init_lora_weights values that draw the factors without reading the base weight (which is split).
PLAIN_INITS = (True, False, "gaussian")


def _refuse_unless_plain(layer: LoraLinear, config) -> None:
    init = config.init_lora_weights
    reasons = []
    if config.lora_bias:
        reasons.append("lora_bias=True")
    if layer.resolve_lora_variant(config=config) is not None:
        reasons.append("a LoRA variant (use_dora, ...)")
    if not any(init is plain or init == plain for plain in PLAIN_INITS):
        reasons.append(f"init_lora_weights={init!r} (it reads the whole base weight)")
    if reasons:
        raise ValueError(f"LoRA on a parallelized model: {type(layer.base_layer).__name__} takes plain LoRA "
                         f"(init_lora_weights True, False or 'gaussian'; no lora_bias, no DoRA or other variant), "
                         f"got {', '.join(reasons)}: change the LoraConfig")


class _ShardedLora(LoraLinear):
    """What the column and row variants share: the whole layer's sizes for peft's bookkeeping (the
    factors are drawn whole, as on the unsharded model, and then split), and the adapters a forward uses."""

    def __init__(self, base_layer, adapter_name, config, **kwargs) -> None:
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.fan_in_fan_out = getattr(base_layer, "transposed", False)  # Conv1D's [in, out] weight

    def _get_in_out_features(self, module: nn.Module):
        if isinstance(module, ReplicatedKeyValue):
            return module.weight.shape[1], module.weight.shape[0]
        return module.full_in_features, module.full_out_features

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs) -> None:
        _refuse_unless_plain(self, config)
        super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
        self.split_adapter(adapter_name)

    def split_adapter(self, adapter_name: str) -> None:
        """Replaces the adapter's whole factors by this rank's slices (once, when the adapter is made)."""
        raise NotImplementedError

    def factors_summed_over_group(self):
        """The whole factors whose gradients the forward already sums over the group (through ``copy``):
        sequence parallelism must not sum them again."""
        raise NotImplementedError

    def _adapters_in_use(self, x, *args, **kwargs):
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.get("adapter_names") is not None:
            raise ValueError("LoRA on a parallelized model: adapter_names= (a batch mixing adapters) is not "
                             "supported; call set_adapter instead")
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return []
        if self.merged:
            return []
        return [name for name in self.active_adapters if name in self.lora_A]


def _slice_factor(linear: nn.Linear, dim: int, pieces) -> None:
    weight = linear.weight
    linear.weight = nn.Parameter(_rows(weight, dim, pieces), requires_grad=weight.requires_grad)
    linear.out_features, linear.in_features = linear.weight.shape


class ColumnLora(_ShardedLora):
    """LoRA around a ColumnProjection or a ReplicatedKeyValue (see the module docstring)."""

    def split_adapter(self, adapter_name: str) -> None:
        base = self.base_layer
        if isinstance(base, ColumnProjection):
            lora_B = self.lora_B[adapter_name]
            _slice_factor(lora_B, 0, base.pieces)
            register_shard(lora_B, "weight", 0, base.full_out_features, base.group, base.blocks, base.unit,
                           base.parts)

    def factors_summed_over_group(self):
        whole_b = isinstance(self.base_layer, ReplicatedKeyValue)  # its rows are taken by _heads, through copy
        return [self.lora_A[n].weight for n in self.lora_A] + ([self.lora_B[n].weight for n in self.lora_B]
                                                               if whole_b else [])

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        active = self._adapters_in_use(x, *args, **kwargs)
        base = self.base_layer
        if not active:
            return base(x)
        read = base.read_input(x)
        result = base.project(read)
        dtype = result.dtype
        for name in active:
            lora_A, lora_B = self.lora_A[name].weight, self.lora_B[name].weight
            h = self.lora_dropout[name](self._cast_input_dtype(read, lora_A.dtype))
            h = F.linear(h, mappings.copy(lora_A, base.group))
            result = result + F.linear(h, base.output_rows(lora_B, 0)) * self.scaling[name]
        return result.to(dtype)


class RowLora(_ShardedLora):
    """LoRA around a RowProjection (see the module docstring)."""

    def split_adapter(self, adapter_name: str) -> None:
        base = self.base_layer
        lora_A = self.lora_A[adapter_name]
        _slice_factor(lora_A, 1, base.pieces)
        register_shard(lora_A, "weight", 1, base.full_in_features, base.group, 1, base.unit, base.parts)

    def factors_summed_over_group(self):
        return [self.lora_B[n].weight for n in self.lora_B]

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        active = self._adapters_in_use(x, *args, **kwargs)
        base = self.base_layer
        if not active:
            return base(x)
        partial = base.partial(x)
        dtype = partial.dtype
        for name in active:
            lora_A, lora_B = self.lora_A[name].weight, self.lora_B[name].weight
            h = F.linear(self.lora_dropout[name](self._cast_input_dtype(x, lora_A.dtype)), lora_A)
            partial = partial + F.linear(h, mappings.copy(lora_B, base.group)) * self.scaling[name]
        return base.finish(partial.to(dtype))


class VocabularyLoraRefused(nn.Module):
    """Stands for a LoRA layer on a vocabulary-parallel embedding or head: refuses when peft makes it."""

    def __init__(self, target, adapter_name, config=None, **kwargs) -> None:
        raise ValueError(f"LoRA on a parallelized model: the vocabulary-parallel {type(target).__name__} takes no "
                         f"LoRA adapter; leave the token embedding and the LM head out of target_modules")


def custom_module_mapping():
    """The custom module mapping a LoraConfig needs on a parallelized model: {base class: LoRA class}
    (the vocabulary-parallel layers map to a refusal: peft would otherwise call them unsupported)."""
    from ..embedding import ParallelEmbedding
    from ..linear import ParallelLinear
    return {ColumnProjection: ColumnLora, ReplicatedKeyValue: ColumnLora, RowProjection: RowLora,
            ParallelLinear: VocabularyLoraRefused, ParallelEmbedding: VocabularyLoraRefused}


def refusal_to_follow(layer: nn.Module):
    """Why peft's LoRA layer ``layer`` cannot follow its base's split (None: it can)."""
    if type(layer) is not LoraLinear:
        return f"a {type(layer).__name__} (only peft's plain LoRA layer, peft.tuners.lora.Linear, can)"
    if layer.merged:
        return f"merged adapters {layer.merged_adapters} (unmerge them first)"
    odd = [name for name in layer.lora_A if name in layer.lora_variant or layer.lora_bias.get(name)]
    if odd:
        return f"adapters {odd} with lora_bias or a variant (DoRA, ...): only plain LoRA can"
    return None


def shard_lora_layer(layer: LoraLinear, base: nn.Module) -> LoraLinear:
    """Turns peft's LoRA layer, whose whole base parallelize just split into ``base``, into the sharded
    one, in place: its class changes (to ColumnLora or RowLora, peft's lora.Linear with another forward)
    and its factors are sliced, so every other state of it (the adapters, the active one, hooks) stays.
    ``refusal_to_follow`` has accepted it before the split."""
    layer.__class__ = RowLora if isinstance(base, RowProjection) else ColumnLora
    layer.base_layer = base
    layer.fan_in_fan_out = getattr(base, "transposed", False)
    for name in list(layer.lora_A):
        layer.split_adapter(name)
    return layer
