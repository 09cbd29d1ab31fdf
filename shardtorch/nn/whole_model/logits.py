"""What a user reads is whole: the logits a parallelized model returns.

The vocabulary-parallel LM head computes this rank's shard of the logits, and
the model's own loss (``labels=``) is computed from the shards inside its
forward. What the forward returns, by ``parallelize``'s ``logits``:

- "lazy" (the default): ``LazyLogits`` (lazy_logits.py), a tensor of the
  whole logits' shape that holds this rank's shard and gathers the whole on
  its first read, on any rank, alone or with the others. A step that reads
  only the loss pays no gather and no whole-logits memory. CPU only (its
  shards are served over Unix sockets, shard_service.py); on other devices,
  under ``torch.compile`` or ``torch.jit`` tracing, for tensor subclasses, and
  where a group spans hosts, "lazy" gathers eagerly as "whole" does.
- "whole": all-gathered along the vocabulary on every forward, only the
  positions the model computed (one per sequence under ``generate``, which
  passes ``logits_to_keep=1``).
- "sharded": the marked shards, for code that knows it holds one (the
  parallel losses) and should not pay for the gather.

``generate`` picks tokens from the logits, so inside it (``generating``) they
are gathered eagerly in every mode, and so inside the proof.

A shard is told by its size, not by a mark: its last dimension is this rank's
vocabulary slice (an element-wise op after the head, Gemma's soft-capping say,
keeps the shard and drops a mark).
"""
import contextlib
from typing import Optional

import torch
from torch import nn

from ...distributed import mappings
from .lazy_logits import lazy_logits
from .shard_service import service_for

LOGITS = ("lazy", "whole", "sharded")


def _is_shard(value, local: int, full: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] == local and local != full


_MODE = "_shardtorch_logits"
_GENERATING = "_shardtorch_generating"


def gather_output_logits(model: nn.Module, local: int, full: int, group: str, mode: str = "lazy"):
    """Makes ``model``'s forward return its logits whole, lazily or eagerly by ``mode`` (see the module
    docstring); with ``mode`` "sharded" only while it generates (``generating``). "lazy" starts the
    group's shard service: a collective, so every rank of the group calls this at the same point."""
    model.__dict__[_MODE] = mode
    service = service_for(group) if mode == "lazy" else None

    def whole(value):
        if service is not None and not model.__dict__.get(_GENERATING, False) and _can_be_lazy(value):
            return lazy_logits(value, full, service)
        return mappings.gather_replicated(value, -1, group, full_size=full)

    def hook(module, args, kwargs, output):
        if module.__dict__.get(_MODE) == "sharded" and not module.__dict__.get(_GENERATING, False):
            return output
        if isinstance(output, tuple):
            return tuple(whole(v) if _is_shard(v, local, full) and i <= 1 else v for i, v in enumerate(output))
        logits = getattr(output, "logits", None) if not isinstance(output, torch.Tensor) else output
        if not _is_shard(logits, local, full):
            return output
        if isinstance(output, torch.Tensor):
            return whole(output)
        output.logits = whole(logits)
        return output
    return model.register_forward_hook(hook, with_kwargs=True)


def _can_be_lazy(value: torch.Tensor) -> bool:
    """A plain CPU tensor outside compilation and tracing (what shard_service.py can serve; the same
    answer on every rank, which numbers its lazy outputs alike)."""
    return type(value) is torch.Tensor and value.device.type == "cpu" and not torch.compiler.is_compiling() \
        and not torch.jit.is_tracing() and not torch.jit.is_scripting()


@contextlib.contextmanager
def generating(model: nn.Module):
    """Inside, ``model``'s forward returns whole logits whatever its mode (transformers' generate picks
    tokens from them)."""
    before = model.__dict__.get(_GENERATING, False)
    model.__dict__[_GENERATING] = True
    try:
        yield
    finally:
        model.__dict__[_GENERATING] = before


def check_logits_option(logits: Optional[str]) -> None:
    if logits not in LOGITS:
        raise ValueError(f"parallelize: logits must be one of {LOGITS}, got {logits!r}")
