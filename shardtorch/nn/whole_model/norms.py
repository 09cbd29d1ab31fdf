"""Norms next to sharded heads.

A norm over each head's features (Qwen3's and Gemma 3's q_norm/k_norm) runs
on this rank's heads with its whole weight: the weight's gradient on a rank
covers only its heads, so it is summed over the group in backward
(``sum_gradients_over_group``).

A norm over a whole projection's output (OLMo 2's q_norm over all heads x
head_dim features) needs every rank's features for its mean of squares: each
rank sums the squares of its own, the group adds the sums (all-reduce forward
and, since every rank's features depend on the total, backward), and the
norm's weight is split with the heads (``HeadShardedRMSNorm``)."""
import torch
from torch import nn

from ...distributed import mappings
from ...utils.shard_facts import register_shard, split_pieces
from .layers import _rows

_SUMMED_ATTR = "_shardtorch_gradient_summed_over"


def sum_gradients_over_group(module: nn.Module, group: str) -> None:
    """Sums the gradients of ``module``'s own parameters over ``group`` in backward. The hook goes on the
    parameter the module holds at its forward, so a parameter replaced after parallelize (a model built
    on the meta device and loaded) gets it too."""
    module.__dict__[_SUMMED_ATTR] = group

    def ensure_hooks(mod, args):
        for param in mod.parameters(recurse=False):
            if param.requires_grad and getattr(param, _SUMMED_ATTR, None) != group:
                param.register_hook(lambda grad: mappings.reduce(grad, group))
                setattr(param, _SUMMED_ATTR, group)
    module.register_forward_pre_hook(ensure_hooks)


def gradients_summed_by_a_hook(module: nn.Module) -> bool:
    """Whether ``sum_gradients_over_group`` already sums ``module``'s gradients."""
    return _SUMMED_ATTR in module.__dict__


class HeadShardedRMSNorm(nn.Module):
    """transformers' RMSNorm (``weight * x / sqrt(mean(x^2) + variance_epsilon)``) over the last dimension
    of a tensor split by heads over the group: the mean is over the whole dimension, the weight this
    rank's heads' slice (``unit`` features per head or group of heads).

    float16/bfloat16 compute in float32, float32 and float64 in their own dtype (shardtorch's rule, as
    the parallel cross-entropy). transformers' RMSNorm computes in float32 whatever the input, float64
    included, so a float64 model split here is more precise than its unsharded self by that rounding
    (the sums of squares over the group cannot add in the order one tensor's mean does anyway)."""

    def __init__(self, source: nn.Module, group: str, group_size: int, group_rank: int, unit: int) -> None:
        super().__init__()
        full = source.weight.shape[0]
        self.group, self.full_size, self.unit = group, full, unit
        self.variance_epsilon = source.variance_epsilon
        pieces = split_pieces(full, group_size, group_rank, 1, unit)
        self.weight = nn.Parameter(_rows(source.weight, 0, pieces), requires_grad=source.weight.requires_grad)
        register_shard(self, "weight", 0, full, group, 1, unit)
        self.train(source.training)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32) if dtype in (torch.float16, torch.bfloat16) else hidden_states
        squares = hidden_states.pow(2).sum(-1, keepdim=True)
        # The whole dimension's sum on every rank; its gradient summed back, since every rank's outputs read it.
        total = mappings.copy(mappings.reduce(squares, self.group), self.group)
        hidden_states = hidden_states * torch.rsqrt(total / self.full_size + self.variance_epsilon)
        return (self.weight * hidden_states).to(dtype)

    def extra_repr(self) -> str:
        return (f"RMS over {self.full_size} features split by heads of {self.unit}, shard={tuple(self.weight.shape)}, "
                f"eps={self.variance_epsilon}, group={self.group!r}")
