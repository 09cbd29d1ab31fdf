"""Whether a model is already under torch's fully_shard (FSDP2), for the
functions that must come before it (converting layers, DDP), and whether a
value is a DTensor or a module an FSDPModule.

Without importing torch.distributed.tensor or torch.distributed.fsdp, which
cost ``import torch, shardtorch`` 0.7 s of its 2.5 s on the development VM
(1.7 to 1.8 s without them): no value can be a DTensor, and no module an FSDPModule,
before its module is imported, so while it is not the answer is no. A
package is in sys.modules from the start of its own import, before any of
its submodules, so the look-up cannot miss a class that exists."""
import sys
from typing import Optional

from torch import nn


def _loaded_class(module: str, name: str):
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def is_dtensor(value) -> bool:
    """Whether ``value`` is a torch.distributed.tensor.DTensor."""
    dtensor = _loaded_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(value, dtensor)


def is_fsdp_module(module) -> bool:
    """Whether ``module`` is under torch's fully_shard (an FSDPModule)."""
    fsdp_module = _loaded_class("torch.distributed.fsdp", "FSDPModule")
    return fsdp_module is not None and isinstance(module, fsdp_module)


def fully_sharded_part(module: nn.Module) -> Optional[str]:
    """A description of the first part of ``module`` under fully_shard (a
    module, or a parameter that is a DTensor), or None when there is none."""
    for name, sub in module.named_modules():
        if is_fsdp_module(sub):
            return f"module {name or type(sub).__name__!r} is under fully_shard"
    for name, parameter in module.named_parameters():
        if is_dtensor(parameter):
            return f"parameter {name!r} is a DTensor"
    return None
