"""Which tensors of a checkpoint make each tensor of the model.

transformers saves some models in their original format and converts them when
loading (``transformers.conversion_mapping``): renamings (GPT-NeoX's
``embed_out`` is the model's ``lm_head``, Mixtral's ``block_sparse_moe`` its
``mlp``) and merges (Mixtral's per-expert ``w1`` / ``w3`` stacked and
concatenated into the fused ``experts.gate_up_proj`` [experts, 2 x
intermediate, width], its ``w2`` stacked into ``experts.down_proj``). The
loader applies transformers' own list of them to the checkpoint's keys, so that
such a checkpoint loads, each rank reading from each source tensor only what
its slices of the merged tensor hold (``read_merged``). Merges other than
stacking a list of tensors and concatenating the stacks are refused by name.
"""
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .safetensors_format import TensorEntry
from .safetensors_read import read_pieces


@dataclass
class Merged:
    """A model tensor of ``shape`` made of checkpoint tensors: ``blocks`` [(entry,
    index along dim 0, offset along ``concat_dim``)], each placed at its index of
    the stacked dimension 0 and its offset along ``concat_dim`` (1 and offset 0
    when the stacks are not concatenated)."""
    shape: Tuple[int, ...]
    dtype: torch.dtype
    concat_dim: int
    blocks: List[Tuple[TensorEntry, int, int]]


def _transforms(model):
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return [], None
    if not isinstance(model, PreTrainedModel):
        return [], None
    return list(get_model_conversion_mapping(model)), WeightConverter


def _merge_shape(converter, who: str) -> int:
    """The concatenation dim of a converter that stacks lists (MergeModulelist(dim=0)) and then
    concatenates them (Concatenate(dim)); raises for any other merge."""
    names = [type(op).__name__ for op in converter.operations]
    dims = [getattr(op, "dim", None) for op in converter.operations]
    if names == ["MergeModulelist"] and dims == [0]:
        return 1
    if names == ["MergeModulelist", "Concatenate"] and dims[0] == 0 and dims[1] >= 1:
        return dims[1]
    raise NotImplementedError(f"{who}: the checkpoint's {converter.source_patterns} become "
                              f"{converter.target_patterns} by {names}: only stacking lists of tensors "
                              f"(MergeModulelist(dim=0)), then concatenating the stacks, is read slice by slice")


def converted_entries(model, entries: Dict[str, TensorEntry], who: str) -> Dict[str, object]:
    """{key after transformers' conversions: TensorEntry or Merged}."""
    transforms, converter_type = _transforms(model)
    if not transforms:
        return dict(entries)
    converted: Dict[str, object] = {}
    parts: Dict[str, Dict[Tuple[int, int], TensorEntry]] = {}
    of_target: Dict[str, object] = {}
    for key, entry in entries.items():
        renamed, merged_by = key, None
        for transform in transforms:
            new, pattern = transform.rename_source_key(renamed)
            if pattern is None:
                continue
            renamed = new
            if isinstance(transform, converter_type):
                merged_by = (transform, pattern)
                break
        if merged_by is None:
            converted[renamed] = entry
            continue
        converter, pattern = merged_by
        index = _list_index(key, pattern)
        parts.setdefault(renamed, {})[(converter.source_patterns.index(pattern), index)] = entry
        of_target[renamed] = converter
    for target, pieces in parts.items():
        converted[target] = _merged(target, pieces, of_target[target], who)
    return converted


def _list_index(key: str, pattern: str) -> int:
    """The index the ``*`` of a source pattern (``.experts.*.w1.weight``) matched in ``key``."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(regex, key)
    return int(found.group(1)) if found and found.groups() else 0


def _merged(target: str, pieces: Dict[Tuple[int, int], TensorEntry], converter, who: str) -> Merged:
    concat_dim = _merge_shape(converter, who)
    sources = sorted({j for j, _ in pieces})
    count = 1 + max(i for _, i in pieces)
    blocks, offset, shape = [], 0, None
    for j in sources:
        entries = [pieces.get((j, i)) for i in range(count)]
        if any(e is None for e in entries) or len({e.shape for e in entries}) != 1:
            raise ValueError(f"{who}: {target!r} merges {converter.source_patterns[j]!r} over {count} entries, but "
                             f"the checkpoint has them incomplete or of different shapes")
        part = entries[0].shape
        for i, entry in enumerate(entries):
            blocks.append((entry, i, offset))
        offset += part[concat_dim - 1]
        shape = (count,) + part[:concat_dim - 1] + (offset,) + part[concat_dim:]
    return Merged(shape, blocks[0][0].dtype, concat_dim, blocks)


def read_merged(merged: Merged, out: torch.Tensor, dim: Optional[int], pieces, fds: Dict[str, int]) -> None:
    """Fills ``out`` (this rank's ``pieces`` along ``dim`` of the merged tensor, or all of it) from the
    checkpoint tensors the merge is made of, reading from each only what ``out`` holds of it."""
    if dim is None:
        dim, pieces = 0, [(0, merged.shape[0])]
    for entry, index, offset in merged.blocks:
        length = entry.shape[merged.concat_dim - 1]
        # The block's extent along the split dim of the merged tensor.
        start, extent = (index, 1) if dim == 0 else (offset, length) if dim == merged.concat_dim else (0, None)
        at = 0
        for piece_offset, count in pieces:
            end = piece_offset + count
            lo, hi = (max(start, piece_offset), min(start + extent, end)) if extent is not None else (
                piece_offset, end)
            if lo < hi:
                _place(merged, entry, index, offset, out, dim, at + lo - piece_offset, lo - start, hi - lo, fds)
            at += count


def _place(merged, entry, index, offset, out, dim, local_at, source_at, count, fds) -> None:
    """Reads ``count`` indices from ``source_at`` along the split dim of the block into ``out`` at ``local_at``."""
    fd = fds.get(entry.path)
    if dim == 0:  # the whole block, at this rank's index of it
        staged = torch.empty(entry.shape, dtype=out.dtype)
        read_pieces(entry, staged, fd=fd)
        region = out.narrow(0, local_at, 1).squeeze(0).narrow(merged.concat_dim - 1, offset, entry.shape[
            merged.concat_dim - 1])
        region.copy_(staged)
        return
    source_dim = dim - 1
    shape = list(entry.shape)
    shape[source_dim] = count
    staged = torch.empty(shape, dtype=out.dtype)
    read_pieces(entry, staged, source_dim, [(source_at, count)], fd=fd)
    region = out.narrow(0, index, 1).squeeze(0).narrow(source_dim, local_at, count)
    if dim != merged.concat_dim:  # the block's place along the concatenated dim (not split here)
        region = region.narrow(merged.concat_dim - 1, offset, entry.shape[merged.concat_dim - 1])
    region.copy_(staged)
