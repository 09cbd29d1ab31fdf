"""What a user reads is whole: the logits a parallelized model returns.

The vocabulary-parallel LM head computes this rank's shard of the logits, and
the model's own loss (``labels=``) is computed from the shards inside its
forward. What the forward returns is then gathered whole (all-gather along
the vocabulary, only the positions the model computed: one position per
sequence under ``generate``, which passes ``logits_to_keep=1``), so that
``argmax``, top-k, sampling and beam search read the unsharded model's
logits. ``parallelize(..., logits="sharded")`` keeps the marked shards in the
output instead, for code that knows it holds one (the parallel losses) and
should not pay for the gather; ``generate`` does not know, so inside it the
logits are gathered whole in either mode.

A shard is told by its size, not by a mark: its last dimension is this rank's
vocabulary slice (an element-wise op after the head, Gemma's soft-capping say,
keeps the shard and drops a mark).
"""
import contextlib
from typing import Optional

import torch
from torch import nn

from ...distributed import mappings

LOGITS = ("whole", "sharded")


def _is_shard(value, local: int, full: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] == local and local != full


_MODE = "_shardtorch_logits"
_GENERATING = "_shardtorch_generating"


def gather_output_logits(model: nn.Module, local: int, full: int, group: str, mode: str = "whole"):
    """Makes ``model``'s forward return its logits whole (see the module docstring); with ``mode``
    "sharded" only while it generates (``generating``)."""
    model.__dict__[_MODE] = mode

    def whole(value):
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
