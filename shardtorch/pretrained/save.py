"""``save_pretrained`` of a parallelized model: the unsharded model's Hugging
Face checkpoint, written tensor by tensor.

Every rank calls it. Global rank 0 writes safetensors files of at most
``max_shard_size`` bytes each (a larger tensor gets a file of its own), with
``model.safetensors.index.json`` when there are several, and the config; each
file's header is written first, from the full shapes alone, then each tensor is
gathered to rank 0 (its shards from the ranks of rank 0's tensor-parallel
group) and appended, so that rank 0 holds at most one whole tensor beyond its
shards (two while transformers' conversion copies one) and no other rank more
than its own. Tied tensors are written once, under the name transformers keeps,
and every tensor under the names, shapes and dtypes that transformers' own save
of the unsharded model writes (its conversion mapping reverted, tensor by
tensor: Mixtral's fused experts as the checkpoint's per-expert ``w1`` / ``w2``
/ ``w3``; original_format.py). The result loads with plain transformers
(``from_pretrained`` of the unsharded class) and with
``ts.nn.from_pretrained`` at any group size.
"""
import json
import math
import os
import re
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..distributed import state
from ..checkpoint.dtensor_entries import whole_shard
from ..checkpoint.layout import model_layout
from .original_format import saved_entries, saved_tensors, unsharded_class
from .checkpoint_files import INDEX_FILE, SINGLE_FILE
from .safetensors_format import build_header
from ..checkpoint.transfers import gather_to
from ..checkpoint.verify import agree_on_problems

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40, "B": 1}


_PARTIAL = ".partial"  # a file being written; renamed to its name once complete


class SavePretrainedError(RuntimeError):
    """Writing the checkpoint failed (on rank 0); every rank raises it."""


def parse_size(size) -> int:
    """Bytes of ``size``: an int, or a string as transformers takes it ("5GB", "500MiB")."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
        if match:
            return int(float(match.group(1)) * _UNITS[match.group(2)])
    raise ValueError(f"save_pretrained: max_shard_size must be a positive number of bytes or a size such as "
                     f"'5GB' or '500MiB', got {size!r}")


def _kept_names(model: nn.Module, names: List[str]) -> List[str]:
    """``names`` with each tied tensor once, under the name transformers keeps
    (not the declared tied target: ``lm_head.weight`` gives way to the embedding)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    targets = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    groups: Dict[int, List[str]] = {}
    for name in names:
        groups.setdefault(id(tensors.get(name, name)), []).append(name)
    keep = set()
    for group in groups.values():
        preferred = [n for n in sorted(group) if n not in targets] or sorted(group)
        keep.add(preferred[0])
    return [name for name in names if name in keep]


def _plan_files(entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]],
                max_bytes: int) -> List[List[Tuple[str, torch.dtype, Tuple[int, ...]]]]:
    files: List[list] = [[]]
    size = 0
    for entry in entries:
        count = 1
        for n in entry[2]:
            count *= n
        nbytes = count * entry[1].itemsize
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def save_pretrained(model: nn.Module, save_directory, max_shard_size="50GB", state_dict: Optional[dict] = None,
                    safe_serialization: bool = True, **ignored) -> None:
    """Writes ``model``'s unsharded checkpoint into ``save_directory`` (see the
    module docstring). Collective over the world."""
    if not safe_serialization:
        raise ValueError("save_pretrained of a parallelized model writes safetensors only "
                         "(safe_serialization=False is not supported)")
    if state_dict is not None:
        raise ValueError("save_pretrained of a parallelized model saves the model's own state dict; "
                         "state_dict= is not supported (its shards could not be told apart)")
    max_bytes = parse_size(max_shard_size)
    folder = os.fspath(save_directory)
    local = model.state_dict()
    layout = model_layout(model, local)
    names = _kept_names(model, [key for key, value in local.items() if torch.is_tensor(value)])
    writer = state.get_rank() == 0
    problem = None
    saved = saved_entries(model, [(name, layout[name].dtype, tuple(layout[name].full_shape)) for name in names])
    plan = _plan_files([entry for name in names for entry in saved[name]], max_bytes)
    handles = []
    if writer:
        try:
            handles = _open_files(model, folder, plan)
        except OSError as error:
            problem = f"cannot write {folder!r}: {error}"
    position = {name: (index, offset) for index, (_, offsets) in enumerate(handles) for name, offset in offsets.items()}
    for name in names:
        entry = layout[name]
        tensor = whole_shard(local[name])  # under fully_shard: collective over its data-parallel mesh
        full = gather_to(tensor, entry, 0) if entry.sharded else (tensor if writer else None)
        if writer and problem is None:
            try:
                for key, piece in saved_tensors(model, name, full, saved[name]).items():
                    index, offset = position[key]
                    _write_tensor(handles[index][0], offset, piece)
            except (OSError, RuntimeError, ValueError) as error:  # a conversion that fails: every rank raises below
                problem = f"cannot write {name!r} into {folder!r}: {error}"
        del full
    for handle, _ in handles:
        handle.close()
        if problem is None:
            # Replacing the finished file (never truncating the old one in place) keeps a model that maps the
            # old file (from_pretrained's copy-on-write maps) valid, and a failed save leaves the old checkpoint.
            os.replace(handle.name, handle.name[:-len(_PARTIAL)])
    agree_on_problems(problem, "save_pretrained: ", error=SavePretrainedError)


def _open_files(model: nn.Module, folder: str, plan) -> List[Tuple[object, Dict[str, int]]]:
    """Writes the config, index and headers; returns (open file, {name: byte offset}) per file."""
    os.makedirs(folder, exist_ok=True)
    count = len(plan)
    names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for stale in os.listdir(folder):  # shards of an earlier save that this one does not overwrite
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", stale) and stale not in names:
            os.remove(os.path.join(folder, stale))
    if count > 1:
        total = sum(dtype.itemsize * math.prod(shape) for tensors in plan for _, dtype, shape in tensors)
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: names[i] for i, tensors in enumerate(plan) for name, _, _ in tensors}}
        with open(os.path.join(folder, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    elif os.path.exists(os.path.join(folder, INDEX_FILE)):
        os.remove(os.path.join(folder, INDEX_FILE))
    _save_configs(model, folder)
    handles = []
    for name, tensors in zip(names, plan):
        header, offsets = build_header(tensors, {"format": "pt"})
        handle = open(os.path.join(folder, name + _PARTIAL), "wb")
        handle.write(header)
        handles.append((handle, offsets))
    return handles


def _write_tensor(handle, offset: int, tensor: torch.Tensor) -> None:
    data = tensor.detach().to("cpu").contiguous()
    handle.seek(offset)
    if data.numel():
        handle.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))


def _save_configs(model: nn.Module, folder: str) -> None:
    """The config (its dtype and architectures as transformers writes them) and the generation config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]
    config.architectures = [unsharded_class(model).__name__]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(folder)
