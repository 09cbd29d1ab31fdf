"""Checks a full (unsharded) checkpoint against a model before any tensor moves.

The rank that holds the checkpoint decides and broadcasts its verdict, so that
every rank raises the same error (naming the keys) instead of some ranks
waiting forever for tensors that will never come.
"""
from typing import Dict, List, Optional, Type

import torch
import torch.distributed as dist

from ..distributed import collectives

from .layout import EntryLayout

DDP_PREFIX = "module."


class CheckpointMismatchError(RuntimeError):
    """The checkpoint does not fit the model: missing, unexpected or misshapen entries."""


def strip_ddp_prefix(name: str) -> str:
    """A parameter's name as the unwrapped model spells it (DDP adds "module.")."""
    while name.startswith(DDP_PREFIX):
        name = name[len(DDP_PREFIX):]
    return name


def match_ddp_prefix(checkpoint: dict, model_keys: List[str]) -> dict:
    """Adds or strips DDP's "module." prefix so that a checkpoint saved with or
    without DDP loads into a model wrapped the other way (a view, no copies)."""
    if not checkpoint or not model_keys:
        return checkpoint
    model_prefixed = all(k.startswith(DDP_PREFIX) for k in model_keys)
    ckpt_prefixed = all(k.startswith(DDP_PREFIX) for k in checkpoint)
    if model_prefixed and not ckpt_prefixed:
        return {DDP_PREFIX + k: v for k, v in checkpoint.items()}
    if ckpt_prefixed and not model_prefixed:
        return {k[len(DDP_PREFIX):]: v for k, v in checkpoint.items()}
    return checkpoint


def mismatches(shapes: Dict[str, tuple], layout: Dict[str, EntryLayout]) -> List[str]:
    """Human-readable problems of a checkpoint ({key: full shape}) for a model."""
    problems = []
    for key in layout:
        if key not in shapes:
            problems.append(f"missing key {key!r} (the model expects shape {tuple(layout[key].full_shape)})")
    for key, shape in shapes.items():
        entry = layout.get(key)
        if entry is None:
            problems.append(f"unexpected key {key!r} (shape {tuple(shape)}) that the model does not have")
        elif tuple(shape) != tuple(entry.full_shape):
            how = (f"the full shape of a tensor sharded along dim {entry.dim} over group {entry.group!r}"
                   if entry.sharded else "a replicated tensor")
            problems.append(f"key {key!r} has shape {tuple(shape)} in the checkpoint but the model expects "
                            f"{tuple(entry.full_shape)} ({how})")
    return problems


def broadcast_verdict(verdict: Optional[object], src: int, what: str,
                      error: Type[Exception] = CheckpointMismatchError) -> object:
    """Sends ``verdict`` (an error message, or a payload) from ``src`` to every
    rank; raises ``error`` everywhere when it is an error."""
    box = [verdict]
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.broadcast_object_list(box, src=src)
    verdict = box[0]
    if isinstance(verdict, str):
        raise error(f"{what}: {verdict}")
    return verdict


def agree_on_problems(problem: Optional[str], prefix: str,
                      error: Type[Exception] = CheckpointMismatchError) -> None:
    """Every rank learns every rank's problem (None: none) and raises ``error``
    (``prefix`` + each rank's problem) when any rank has one, so that a
    mismatch on one rank is an error on all, never a wrong transfer or a hang."""
    verdicts = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        collectives.all_gather_object(verdicts, problem)
    bad = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict]
    if bad:
        raise error(prefix + "; ".join(f"rank {rank}: {verdict}" for rank, verdict in bad))


def shapes_of(checkpoint: dict) -> Dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in checkpoint.items() if isinstance(v, torch.Tensor)}
