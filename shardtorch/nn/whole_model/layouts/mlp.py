"""MLP layouts: an up projection (or gate and up) column-parallel, the down
projection row-parallel, no gather between them (Megatron's pairing).

Recognised by the projections' names (the families' MLP entries,
families.py: pairs, gated, fused gated [gate | up], BERT's nested
``intermediate.dense/output.dense``) and sizes (up.out == down.in), or by
structure: ``nn.Sequential(Linear, elementwise..., Linear)``. Other parameters in the module must be norms over
the model's width (OPT's decoder layer holds its layer norms and its
attention beside fc1/fc2): a norm over the hidden features between the two
projections would read a shard, so such a module is not recognised.
"""
from dataclasses import astuple
from typing import Optional

from torch import nn

from ..layers import ColumnProjection, block_input, is_conv1d
from .base import Fit, Layout, linear, own_parameters_only_in, projection, row, too_few
from .families import FUSED_GATED_MLPS, GATED_MLPS, NESTED_MLPS, PAIR_MLPS, reads_whole_weights

# Modules without parameters that act element by element (allowed between the
# two projections of a Sequential MLP).
_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.Mish, nn.LeakyReLU)


def _in_out(proj):
    return (proj.nx, proj.nf) if is_conv1d(proj) else (proj.in_features, proj.out_features)


def _holds_attention(m, names) -> bool:
    from . import find_layout
    return any(name not in names and find_layout(child, "attention") is not None for name, child in m.named_children())


def _others_are_width_norms_or_attention(m, names, width) -> bool:
    """Whether ``m`` holds nothing but the projections ``names``, or is a whole transformer layer: an
    attention child of a known layout, and otherwise only 1-D parameters of ``width`` elements (its norms
    over the model's width, OPT's decoder layer)."""
    from . import find_layout
    skip = {id(p) for name in names for p in getattr(m, name).parameters()}
    attention = [child for name, child in m.named_children()
                 if name not in names and find_layout(child, "attention") is not None]
    if not attention:
        return all(id(p) in skip for p in m.parameters())
    skip.update(id(p) for child in attention for p in child.parameters())
    return all(id(p) in skip or (p.dim() == 1 and p.shape[0] == width) for p in m.parameters())


class _MLP(Layout):
    kind = "mlp"

    def refusal(self, m, fit, size):
        return too_few("hidden features", fit.hidden, size)


class PairMLP(_MLP):
    """An up projection then a down projection."""

    def fit(self, m):
        for entry in PAIR_MLPS:
            up_name, down_name = entry.up, entry.down
            up, down = projection(m, up_name), projection(m, down_name)
            if up is None or down is None:
                continue
            (up_in, hidden), (down_in, down_out) = _in_out(up), _in_out(down)
            if hidden != down_in or up_in != down_out:
                return None
            if reads_whole_weights(m):
                return None
            whole_layer = _holds_attention(m, (up_name, down_name))
            if not _others_are_width_norms_or_attention(m, (up_name, down_name), up_in):
                return None
            # In a whole layer (OPT's) the up projection does not read the layer's input, which is what
            # sequence parallelism would gather.
            return Fit(f"{up_name}/{down_name}" + (" in the layer" if whole_layer else ""),
                       names=(up_name, down_name), hidden=hidden, sequence_parallel=not whole_layer)
        return None

    def apply(self, m, fit, group, size, rank, sp=False):
        up, down = fit.names
        setattr(m, up, ColumnProjection(getattr(m, up), group, size, rank, block_input(group, 1, sp)))
        setattr(m, down, row(sp, getattr(m, down), group, size, rank))
        return {}


class GatedMLP(_MLP):
    """Gate and up projections, multiplied, then down."""

    def fit(self, m):
        for entry in GATED_MLPS:
            names = (entry.gate, entry.up, entry.down)
            gate, up, down = (linear(m, n) for n in names)
            if gate is None or up is None or down is None:
                continue
            if not (gate.out_features == up.out_features == down.in_features
                    and gate.in_features == up.in_features == down.out_features):
                return None
            if not _others_are_width_norms_or_attention(m, names, up.in_features):
                return None
            return Fit("/".join(names), names=names, hidden=up.out_features)
        return None

    def apply(self, m, fit, group, size, rank, sp=False):
        gate, up, down = fit.names
        shared = block_input(group, 2, sp)
        setattr(m, gate, ColumnProjection(getattr(m, gate), group, size, rank, shared))
        setattr(m, up, ColumnProjection(getattr(m, up), group, size, rank, shared))
        setattr(m, down, row(sp, getattr(m, down), group, size, rank))
        return {}


class FusedGatedMLP(_MLP):
    """One projection [gate | up] (the forward chunks its output in two), then down (Phi-3)."""

    def fit(self, m):
        for entry in FUSED_GATED_MLPS:
            names = (entry.gate_up, entry.down)
            fused, down = (linear(m, n) for n in names)
            if fused is None or down is None:
                continue
            if fused.out_features != 2 * down.in_features or fused.in_features != down.out_features:
                return None
            if not _others_are_width_norms_or_attention(m, names, fused.in_features):
                return None
            return Fit("/".join(names), names=names, hidden=down.in_features)
        return None

    def apply(self, m, fit, group, size, rank, sp=False):
        fused, down = fit.names
        # The same slice of the gate's half and of the up half: two blocks.
        setattr(m, fused, ColumnProjection(getattr(m, fused), group, size, rank, block_input(group, 1, sp),
                                           blocks=2))
        setattr(m, down, row(sp, getattr(m, down), group, size, rank))
        return {}


class BertMLP(_MLP):
    """BERT's layer: ``intermediate.dense`` then ``output.dense`` (the
    attention's ``output`` is another module): a NestedMLP entry."""

    def fit(self, m):
        for entry in NESTED_MLPS:
            inter, out = getattr(m, entry.up_module, None), getattr(m, entry.down_module, None)
            if inter is None or out is None or linear(inter, entry.projection) is None or \
                    linear(out, entry.projection) is None:
                continue
            up, down = getattr(inter, entry.projection), getattr(out, entry.projection)
            if not (hasattr(m, entry.beside) and up.out_features == down.in_features
                    and own_parameters_only_in(inter, [entry.projection])):
                return None
            return Fit("bert", hidden=up.out_features, entry=entry)
        return None

    def gather_point(self, m, fit):
        return getattr(m, fit.entry.up_module)

    def apply(self, m, fit, group, size, rank, sp=False):
        inter, out, name = getattr(m, fit.entry.up_module), getattr(m, fit.entry.down_module), fit.entry.projection
        setattr(inter, name, ColumnProjection(getattr(inter, name), group, size, rank, block_input(group, 1, sp)))
        setattr(out, name, row(sp, getattr(out, name), group, size, rank))
        return {}


class SequentialMLP(_MLP):
    """``nn.Sequential(Linear, elementwise..., Linear[, Dropout])`` (minGPT's block MLP)."""

    def fit(self, m):
        if not isinstance(m, nn.Sequential):
            return None
        children = list(m.named_children())
        linears = [i for i, (_, c) in enumerate(children) if isinstance(c, nn.Linear)]
        if len(linears) != 2 or linears[0] != 0:
            return None
        others = [c for i, (_, c) in enumerate(children) if i not in linears]
        if not all(type(c) in _ELEMENTWISE for c in others):
            return None
        (up_name, up), (down_name, down) = children[linears[0]], children[linears[1]]
        if up.out_features != down.in_features:
            return None
        return Fit("sequential", names=(up_name, down_name), hidden=up.out_features)

    def apply(self, m, fit, group, size, rank, sp=False):
        up_name, down_name = fit.names
        m._modules[up_name] = ColumnProjection(m._modules[up_name], group, size, rank, block_input(group, 1, sp))
        m._modules[down_name] = row(sp, m._modules[down_name], group, size, rank)
        return {}


def is_mlp_like(module: nn.Module) -> Optional[str]:
    """A description when ``module`` holds an up/down pair of projections of the known names (an MLP that
    no layout took), for the list of what stays whole."""
    for entry in PAIR_MLPS + GATED_MLPS + FUSED_GATED_MLPS:
        names = astuple(entry)
        if all(projection(module, n) is not None for n in names):
            return "/".join(names)
    return None
