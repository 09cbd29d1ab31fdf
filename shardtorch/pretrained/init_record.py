"""What a model's construction wrote into its meta tensors: the record that meta_build.py keeps and
init_replay.py replays (a module of its own, so that neither of them imports the other)."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

aten = torch.ops.aten

# In-place random fills: a write that reads nothing of the old values.
RANDOM_WRITES = {aten.uniform_, aten.normal_, aten.bernoulli_, aten.random_, aten.exponential_,
                 aten.log_normal_, aten.cauchy_, aten.geometric_}
# Writes that replace every element they cover without reading them.
OVERWRITES = RANDOM_WRITES | {aten.fill_, aten.zero_, aten.copy_}
# Random fills drawn whole in chunks (chunked_draw.py) rather than by the op on the whole tensor.
CHUNKABLE = {aten.uniform_, aten.normal_}


def storage_key(tensor: torch.Tensor) -> int:
    """Identifies the storage ``tensor`` views (stable while the storage lives; the record keeps it alive)."""
    return tensor.untyped_storage()._cdata


@dataclass
class Write:
    """One recorded write into a meta tensor: ``func(*args, **kwargs)`` with
    ``args[0]`` the written view; ``rng_state`` the state of the generator it
    draws from (random writes only), ``generator`` that generator (None: the
    default CPU generator)."""
    func: Any
    args: tuple
    kwargs: dict
    rng_state: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None

    @property
    def target(self) -> torch.Tensor:
        return self.args[0]

    @property
    def random(self) -> bool:
        return self.func.overloadpacket in RANDOM_WRITES

    @property
    def overwrites(self) -> bool:
        return self.func.overloadpacket in OVERWRITES


@dataclass
class InitRecord:
    """What the construction wrote into its meta tensors, in order, per storage."""
    writes: Dict[int, List[Write]] = field(default_factory=dict)
    origin: Dict[int, str] = field(default_factory=dict)  # "empty" | "computed by <op>"
    copied: Dict[int, torch.Tensor] = field(default_factory=dict)  # storage made as a copy of this tensor
    keep: List[torch.Tensor] = field(default_factory=list)  # keeps recorded storages (and their keys) alive
