"""Converting the layers of an existing model to their parallel versions."""
from typing import Callable, Type

from torch import nn

from ..utils.fsdp_detection import fully_sharded_part


def replace_modules(module: nn.Module, source: Type[nn.Module], convert: Callable[[nn.Module], nn.Module],
                    converted: Type[nn.Module]) -> nn.Module:
    """``convert(module)`` when ``module`` is a ``source``; otherwise ``module``
    with every nested ``source`` replaced by ``convert`` of it, in place.
    Modules that already are ``converted`` are left as they are. Converting
    comes before fully_shard: a model under it raises (its parameters are
    DTensors, and a new layer would not be sharded by it)."""
    sharded_by_fsdp = fully_sharded_part(module)
    if sharded_by_fsdp:
        raise TypeError(f"converting {source.__name__} layers to {converted.__name__}: the model is under "
                        f"fully_shard ({sharded_by_fsdp}); convert first, then call fully_shard")
    return _replace(module, source, convert, converted)


def _replace(module: nn.Module, source: Type[nn.Module], convert: Callable[[nn.Module], nn.Module],
             converted: Type[nn.Module]) -> nn.Module:
    if isinstance(module, source):
        return convert(module)
    for name, child in module.named_children():
        if isinstance(child, converted):
            continue
        setattr(module, name, _replace(child, source, convert, converted))
    return module
