"""Where each tensor of a parallelized (meta) model comes from in the checkpoint, its rank's slices of
it, and reading them: one read per run of the file straight into the tensor that keeps it, or a
copy-on-write map of the file where the slice is one run in its own dtype."""
import os
from typing import Dict, List, Optional, Set

import torch
from torch import nn

from ..distributed import state
from ..utils.shard_facts import named_parameter_shards
from .checkpoint_keys import Merged, read_merged
from .materialize import named_tensors
from .safetensors_read import read_pieces


class SliceRead:
    """Where one tensor of the model comes from: the file's tensor ``entry``,
    its slices ``pieces`` along ``dim`` (None: whole), under ``names``."""

    def __init__(self, entry, dim, pieces, names):
        self.entry, self.dim, self.pieces, self.names = entry, dim, pieces, names

    def run(self, tensor: torch.Tensor) -> Optional[int]:
        """The first element of the file's tensor from which ``tensor`` lies as
        one run of the file's bytes in its own dtype (so that it can be
        mapped); None where it does not."""
        if isinstance(self.entry, Merged) or tensor.dtype != self.entry.dtype or tensor.numel() == 0:
            return None
        if self.dim is None:
            return 0
        outer = 1
        for n in self.entry.shape[:self.dim]:
            outer *= n
        if outer != 1 or len(self.pieces) != 1:
            return None
        inner = tensor.numel() // max(tensor.shape[self.dim], 1)
        return self.pieces[0][0] * inner


def slice_reads_of(model: nn.Module, keys: Dict[str, str], entries) -> Dict[int, SliceRead]:
    """{id(tensor): SliceRead} for every tensor of the (parallelized, meta) model
    that the checkpoint holds, each tensor once (a tied tensor under all its names)."""
    specs = {name: spec for name, _, spec in named_parameter_shards(model)}
    tensors = named_tensors(model)
    names_of: Dict[int, List[str]] = {}
    for name in model.state_dict(keep_vars=True):
        names_of.setdefault(id(tensors[name]), []).append(name)
    plan = {}
    for ident, names in names_of.items():
        source = next((n for n in names if n in keys), None)
        if source is None:
            continue
        entry = entries[keys[source]]
        spec = specs.get(source)
        dim = pieces = None
        if spec is not None:
            size, rank = state.get_group_size(spec.group), state.get_group_rank(spec.group)
            dim, pieces = spec.dim, spec.pieces(entry.shape[spec.dim], size, rank)
        plan[ident] = SliceRead(entry, dim, pieces, names)
    return plan


def read_planned(model: nn.Module, reads: Dict[int, SliceRead], mapped: Set[int]) -> Set[str]:
    """Reads every planned tensor not mapped (``mapped``: ids of the meta
    tensors they replaced) into ``model``; returns the names filled (mapped
    ones included)."""
    tensors = named_tensors(model)
    loaded = set()
    descriptors: Dict[str, int] = {}
    try:
        for ident, read in reads.items():
            loaded.update(read.names)
            if ident in mapped:
                continue
            tensor = tensors[read.names[0]]
            with torch.no_grad():
                target = tensor if tensor.is_contiguous() else torch.empty_like(
                    tensor, memory_format=torch.contiguous_format)
                if isinstance(read.entry, Merged):
                    read_merged(read.entry, target, read.dim, read.pieces, descriptors)
                else:
                    path = read.entry.path
                    if path not in descriptors:
                        descriptors[path] = os.open(path, os.O_RDONLY)
                    read_pieces(read.entry, target, read.dim, read.pieces, fd=descriptors[path])
                if target is not tensor:
                    tensor.copy_(target)
    finally:
        for fd in descriptors.values():
            os.close(fd)
    return loaded
