"""The optimizer's parameters as the unsharded model names them, and what
kind each piece of their state is (sharded like its parameter, replicated, or
one plain value)."""
import dataclasses
from typing import Dict, FrozenSet, List, Optional

import torch

from ..layout import EntryLayout, model_layout
from ..verify import strip_ddp_prefix

#: Group entries that name parameters rather than set hyperparameters.
PARAM_KEYS = ("params", "param_names")


def is_zero(optimizer) -> bool:
    """A ZeroRedundancyOptimizer (its state is spread over its ranks)."""
    return hasattr(optimizer, "consolidate_state_dict") and hasattr(optimizer, "optim")


def class_name(optimizer) -> str:
    """The optimizer that keeps the state (ZeroRedundancyOptimizer's inner one)."""
    return type(optimizer.optim).__name__ if is_zero(optimizer) else type(optimizer).__name__


def row_state_keys(optimizer) -> FrozenSet[str]:
    """State keys that the optimizer keeps one value per parameter row of, as
    [rows] tensors (shardtorch.optim's ``row_step``): its ``row_state_keys``."""
    inner = optimizer.optim if is_zero(optimizer) else optimizer
    return frozenset(getattr(inner, "row_state_keys", ()))


def hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in PARAM_KEYS}


class OptimizerParams:
    """The optimizer's parameters in ``state_dict()`` index order, each with
    its name in the model (without DDP's prefix: the unsharded model's name,
    which is also torch.distributed.checkpoint's FQN) and its layout entry."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        names = {}
        keys = {}
        for key, param in model.named_parameters():
            names.setdefault(id(param), strip_ddp_prefix(key))
            keys.setdefault(id(param), key)
        self.groups: List[List[int]] = []   # per group: indices
        self.params: List[torch.Tensor] = []
        self.names: List[str] = []
        self.model_keys: List[str] = []
        unknown = []
        for group in optimizer.param_groups:
            indices = []
            for param in group["params"]:
                if id(param) not in names:
                    unknown.append(f"group {len(self.groups)} position {len(indices)} "
                                   f"(shape {tuple(param.shape)})")
                    names[id(param)] = keys[id(param)] = f"<unknown {len(self.params)}>"
                indices.append(len(self.params))
                self.params.append(param)
                self.names.append(names[id(param)])
                self.model_keys.append(keys[id(param)])
            self.groups.append(indices)
        self.unknown = unknown
        self.row_keys = row_state_keys(optimizer)
        self.layout: Dict[str, EntryLayout] = {}

    def read_layout(self, model, layout: Optional[Dict[str, EntryLayout]] = None) -> None:
        """Collective (unless ``layout``, the model's, already covers every
        parameter); done after the rank verdicts so that a bad call never hangs in it."""
        if layout is not None and all(k in layout for k in self.model_keys):
            self.layout = layout
        else:
            self.layout = model_layout(model)

    def entry(self, index: int) -> EntryLayout:
        return self.layout[self.model_keys[index]]

    def named_groups(self, groups: List[dict], with_indices: bool) -> List[dict]:
        """``groups`` (a state dict's param_groups, one per optimizer group)
        with their hyperparameters, ``param_names`` from this optimizer and,
        ``with_indices``, ``params`` as this optimizer's indices."""
        result = []
        for group, indices in zip(groups, self.groups):
            group = hyperparameters(group)
            if with_indices:
                group["params"] = list(indices)
            group["param_names"] = [self.names[i] for i in indices]
            result.append(group)
        return result


#: Kinds of state tensors split over the parameter's group (the others are
#: kept whole: "replicated", or one "value").
SPLIT_KINDS = ("sharded", "rows")


def state_kind(value, param: torch.Tensor, entry: Optional[EntryLayout], row_state: bool = False) -> Optional[str]:
    """How one state value of ``param`` travels: "value" (a 0-d tensor or a
    non-tensor, kept as one), "replicated", "sharded" (shaped like a sharded
    parameter's shard), "rows" (``row_state``, one value per row of a
    parameter split along dim 0: split like its rows; per-row state of a
    parameter split along another dim is the same on every rank, replicated),
    or None: a tensor of a sharded parameter that is none of these, which
    cannot be classified."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return "value"
    if entry is None or not entry.sharded:
        return "replicated"
    if tuple(value.shape) == tuple(param.shape):
        return "sharded"
    if row_state and param.dim() >= 1 and tuple(value.shape) == tuple(param.shape[:1]):
        return "rows" if entry.dim == 0 else "replicated"
    return None


def split_state_entry(entry: EntryLayout, kind: str, key: str, dtype: torch.dtype,
                      device: torch.device) -> EntryLayout:
    """The layout of a state tensor of a SPLIT_KINDS ``kind`` of the parameter
    laid out as ``entry``: the parameter's own, or (rows) that of its dim 0."""
    if kind == "rows":
        return EntryLayout(key, entry.local_shape[:1], entry.full_shape[:1], dtype, device, 0, entry.group,
                           entry.group_rank, entry.group_size, blocks=entry.blocks, unit=entry.unit,
                           parts=entry.parts)
    return dataclasses.replace(entry, key=key, dtype=dtype, device=device)
