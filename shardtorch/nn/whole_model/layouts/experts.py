"""Mixture of experts: every expert's MLP split along its intermediate
dimension, each rank holding a slice of every expert (Megatron's way); the
router stays whole, so every rank routes every token alike.

transformers 5 keeps the experts of Mixtral, Qwen-MoE, DeepSeek, ... as 3-D
parameters in one module (an ``ExpertBank`` entry, families.py):
``gate_up_proj`` [experts, 2 x intermediate, width] ([gate | up] per expert,
or gate and up interleaved) and ``down_proj`` [experts, width, intermediate]
(both transposed where the module says ``is_transposed``). Each rank's slice of the intermediate dimension gives a
partial sum of every token's output: the module's output is all-reduced once
(forward), and its floating-point inputs (the hidden states, the routing
weights) pass through ``copy`` (their gradients all-reduced in backward).
Experts kept as a list of modules are MLPs of their own (mlp.py).
"""
import torch
from torch import nn

from ....distributed import mappings
from ....utils.shard_facts import register_shard, split_pieces
from ..layers import _rows
from .base import Fit, Layout, int_attr, too_few
from .families import EXPERT_BANKS, EXPERTS_CLASS_WORD, ExpertBank


class FusedExperts(Layout):
    kind = "experts"
    sequence_parallel = False

    def fit(self, m):
        for bank in EXPERT_BANKS:
            fit = _bank_fit(m, bank)
            if fit is not None:
                return fit
        return None

    def refusal(self, m, fit, size):
        return too_few("intermediate features per expert", fit.hidden, size)

    def apply(self, m, fit, group, size, rank, sp=False):
        gate_up_dim, down_dim = fit.dims
        bank = fit.bank
        # [gate | up]: the same slice of both halves (two blocks); interleaved: pairs of rows (unit 2).
        blocks, unit = (1, 2) if fit.interleaved else (2, 1)
        for name, dim, b, u in ((bank.gate_up, gate_up_dim, blocks, unit), (bank.down, down_dim, 1, 1)):
            param = m._parameters[name]
            pieces = split_pieces(param.shape[dim], size, rank, b, u)
            m._parameters[name] = nn.Parameter(_rows(param, dim, pieces), requires_grad=param.requires_grad)
            register_shard(m, name, dim, param.shape[dim], group, b, u)
        local = m._parameters[bank.down].shape[down_dim]
        changed = {f"{bank.gate_up} / {bank.down}": f"{local} of {fit.hidden} intermediate features per expert"}
        if int_attr(m, bank.intermediate) == fit.hidden:
            setattr(m, bank.intermediate, local)
            changed[bank.intermediate] = local
        m.register_forward_pre_hook(_copy_floating_inputs(group), with_kwargs=True)
        m.register_forward_hook(lambda _, args, output: mappings.reduce(output, group))
        return changed


def _bank_fit(m: nn.Module, bank: ExpertBank):
    params = dict(m.named_parameters(recurse=False))
    if set(params) != {bank.gate_up, bank.down} or any(True for c in m.children() for _ in c.parameters()):
        return None
    gate_up, down = params[bank.gate_up], params[bank.down]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return None
    if getattr(m, bank.has_gate, True) is not True or getattr(m, bank.has_bias, False) or \
            getattr(m, bank.post_norm, False):
        return None
    transposed = bool(getattr(m, bank.transposed, False))
    # [experts, 2 x intermediate, width] / [experts, width, intermediate], or both transposed.
    gate_up_dim, down_dim = (2, 1) if transposed else (1, 2)
    hidden = down.shape[down_dim]
    width = gate_up.shape[3 - gate_up_dim]
    if gate_up.shape[gate_up_dim] != 2 * hidden or down.shape[3 - down_dim] != width:
        return None
    interleaved = getattr(m, bank.concatenated, True) is False
    return Fit("3-D experts" + (" (gate/up interleaved)" if interleaved else ""), hidden=hidden,
               dims=(gate_up_dim, down_dim), interleaved=interleaved, bank=bank)


def _copy_floating_inputs(group):
    """Every rank's gradient of the hidden states and routing weights covers its slice of the experts:
    ``copy`` sums them over the group in backward. Routing weights of a narrower dtype than the hidden
    states (Mixtral's router computes them in float32, a float64 model's hidden states are wider) are
    widened to the hidden states' dtype first, as the experts' product widens them anyway: their
    gradient is then summed over the group in the wide dtype and rounded once, as the unsharded model
    rounds it. The hidden states keep their dtype (the first floating input): widening bfloat16 ones
    to the float32 routing weights' would hand the experts' bfloat16 weights float32 inputs."""
    def hook(_, args, kwargs):
        floating = [v for v in list(args) + list(kwargs.values()) if torch.is_tensor(v) and v.is_floating_point()]
        hidden = floating[0].dtype if floating else None

        def copy(value):
            if not (torch.is_tensor(value) and value.is_floating_point()):
                return value
            return mappings.copy(value.to(torch.promote_types(value.dtype, hidden)), group)
        return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}
    return hook


def is_experts_like(module: nn.Module) -> bool:
    """A bank of experts that no layout took: a module named for experts holding 3-D parameters of its own,
    or holding two or more of them with the same number of experts (a position table [1, positions, width]
    is neither)."""
    banks = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3 and p.shape[0] > 1]
    return bool(banks) and (EXPERTS_CLASS_WORD in type(module).__name__ or len(banks) >= 2 and len(set(banks)) == 1)
