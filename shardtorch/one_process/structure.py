"""Walking a model's inputs and outputs (tensors inside tuples, lists, dicts, Hugging Face's
ModelOutput) on both sides of the pipe, and the small markers that stand in for what stays on a
worker."""
from dataclasses import dataclass
from typing import Any, Callable, Tuple

import torch

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, slice,
          type(Ellipsis))


@dataclass(frozen=True)
class TensorSlot:
    """Output tensor number ``index`` of a reply's tensor list."""
    index: int


@dataclass(frozen=True)
class LazySlot:
    """Lazy whole logits that a worker keeps (shardtorch's ``logits="lazy"``): read on first use."""
    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class KeptObject:
    """An object that is not data (a key/value cache holding each rank's heads): it stays on every
    worker, and passing the marker back in (``past_key_values=out.past_key_values``) gives each rank
    its own."""
    step: int
    index: int


def map_structure(value: Any, on_tensor: Callable, on_other: Callable) -> Any:
    """``value`` with every tensor replaced by ``on_tensor(tensor)`` and every leaf that is neither
    a tensor, a container nor a plain value by ``on_other(leaf)``; containers keep their type."""
    def walk(item):
        if isinstance(item, torch.Tensor):
            return on_tensor(item)
        if isinstance(item, _PLAIN):
            return item
        if isinstance(item, (TensorSlot, LazySlot, KeptObject)):
            return on_other(item)
        if isinstance(item, tuple) and hasattr(item, "_fields"):  # a namedtuple
            return type(item)(*(walk(x) for x in item))
        if isinstance(item, (tuple, list)):
            return type(item)(walk(x) for x in item)
        if isinstance(item, dict):
            walked = {key: walk(x) for key, x in item.items()}
            if type(item) is dict:
                return walked
            try:  # ModelOutput and other dict types built from their fields
                return type(item)(**walked)
            except TypeError:
                return type(item)(walked)
        return on_other(item)
    return walk(value)
