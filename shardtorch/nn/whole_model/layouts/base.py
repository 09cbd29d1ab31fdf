"""What every layout shares: the Layout interface and the structural tests
the layouts read a module with."""
from typing import Dict, Iterable, Optional

from torch import nn

from ..layers import RowProjection, is_projection


class Layout:
    """One known layout of a module: ``kind`` is its plan style ("attention",
    "mlp" or "experts").

    ``fit(module)`` reads the module once and returns what applying needs (a
    Fit), or None where the module does not have this layout; the plan keeps
    the Fit, so a module's layout is found once (shardtorch.nn.whole_model.plan).
    """
    kind = ""
    #: Whether its placement works inside a sequence-parallel region.
    sequence_parallel = True

    def fit(self, module: nn.Module) -> Optional["Fit"]:
        raise NotImplementedError

    def refusal(self, module: nn.Module, fit: "Fit", size: int) -> Optional[str]:
        """Why ``module`` cannot split over ``size`` ranks (None: it can)."""
        return None

    def apply(self, module: nn.Module, fit: "Fit", group: str, size: int, rank: int,
              sp: bool = False) -> Dict[str, object]:
        """Shards ``module`` in place; returns the attributes it changed (name: new value). ``sp``: sequence
        parallelism (the column projections read the input ``gather_point`` gathered, the row ones
        reduce-scatter)."""
        raise NotImplementedError

    def gather_point(self, module: nn.Module, fit: "Fit") -> nn.Module:
        """The submodule whose input is gathered along the sequence under sequence parallelism: the one
        whose forward reads the hidden states' shape and feeds the column projections, and not the
        residual (BERT adds it inside its attention and output modules)."""
        return module

    def head_dropout_region(self, module: nn.Module, fit: "Fit") -> Optional[nn.Module]:
        """The submodule whose forward draws dropout only on this rank's heads
        (to draw from the model-parallel stream), or None where its forward
        may also drop replicated activations, or is not known to."""
        return None


class Fit:
    """What a layout read from one module: ``variant`` names the layout in
    reports; the rest is the layout's own."""

    def __init__(self, variant: str, **facts) -> None:
        self.variant = variant
        self.__dict__.update(facts)

    def __repr__(self) -> str:
        return f"Fit({self.variant})"


def own_parameters_only_in(module: nn.Module, names: Iterable[str]) -> bool:
    """Whether every parameter of ``module`` belongs to one of its children ``names``."""
    allowed = {id(p) for name in names for p in getattr(module, name).parameters()}
    return all(id(p) in allowed for p in module.parameters())


def projection(module: nn.Module, name: str) -> Optional[nn.Module]:
    """The child ``name`` if it is an nn.Linear (a subclass whose forward is nn.Linear's own, or computes
    the same product, such as Falcon's) or a Conv1D, else None."""
    child = getattr(module, name, None)
    return child if child is not None and is_projection(child) else None


def linear(module: nn.Module, name: str) -> Optional[nn.Linear]:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def int_attr(module, name: str) -> Optional[int]:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def too_few(what: str, count: int, size: int) -> Optional[str]:
    if count < size:
        return f"{count} {what} cannot be split over {size} ranks (every rank needs at least one)"
    return None


def row(sp: bool, source: nn.Module, group: str, size: int, rank: int, unit: int = 1) -> RowProjection:
    # Sequence parallelism: reduce-scatter along the sequence (dim 1 of [batch, sequence, features]).
    return RowProjection(source, group, size, rank, unit, sequence_dim=1 if sp else None)

