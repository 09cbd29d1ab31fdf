"""Whether a model is already under torch's fully_shard (FSDP2), for the
functions that must come before it (converting layers, DDP)."""
from typing import Optional

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def fully_sharded_part(module: nn.Module) -> Optional[str]:
    """A description of the first part of ``module`` under fully_shard (a
    module, or a parameter that is a DTensor), or None when there is none."""
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            return f"module {name or type(sub).__name__!r} is under fully_shard"
    for name, parameter in module.named_parameters():
        if isinstance(parameter, DTensor):
            return f"parameter {name!r} is a DTensor"
    return None
