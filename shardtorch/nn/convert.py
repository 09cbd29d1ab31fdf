"""Converting the layers of an existing model to their parallel versions."""
from typing import Callable, Type

from torch import nn


def replace_modules(module: nn.Module, source: Type[nn.Module], convert: Callable[[nn.Module], nn.Module],
                    converted: Type[nn.Module]) -> nn.Module:
    """``convert(module)`` when ``module`` is a ``source``; otherwise ``module``
    with every nested ``source`` replaced by ``convert`` of it, in place.
    Modules that already are ``converted`` are left as they are."""
    if isinstance(module, source):
        return convert(module)
    for name, child in module.named_children():
        if isinstance(child, converted):
            continue
        setattr(module, name, replace_modules(child, source, convert, converted))
    return module
