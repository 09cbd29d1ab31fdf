"""Logits that are whole when read and cost nothing when not (``parallelize``'s default, ``logits="lazy"``).

A training step that reads only the loss never looks at the logits its model returns, so gathering
them on every forward (``logits="whole"``) costs an all-gather of [tokens, vocabulary] and its memory
for nothing. ``LazyLogits`` stands in for the whole logits instead: a tensor with their shape, dtype
and device that holds only this rank's vocabulary shard. The first operation that reads it (any
torch op: argmax, slicing, comparison, ``item``, printing, ``numpy()``, ...) fetches the other ranks'
shards, caches the whole, and runs on it, so what the user reads is the unsharded model's logits.

The fetch is not a collective: each rank's shard service (shard_service.py) answers it, so a read on
one rank alone works while its peers go on (they keep their shard while any rank's output lives).

Gradients: the lazy tensor is the output of an autograd function of the shard whose backward keeps
this rank's slice of the gradient (as ``mappings.gather_replicated``), so a loss that every rank
computes from the whole logits gives the unsharded model's gradients.
"""
import copy

import torch
from torch.utils._pytree import tree_map

from .shard_service import ShardService


def _slice_of(full: int, size: int, rank: int):
    """(offset, length) of ``rank``'s slice of ``full`` (the split rule: the first full % size ranks hold
    one more)."""
    base, extra = divmod(full, size)
    return rank * base + min(rank, extra), base + (rank < extra)


class WholeOnRead(torch.Tensor):
    """A tensor that stands for a whole one held elsewhere and fetches it (``whole()``) when first
    read: every torch op, and the Tensor methods that read data without an op of their own. The
    lazy logits here and, in one_process, the logits a worker keeps for its caller."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def whole(value):
            return value.whole() if isinstance(value, WholeOnRead) else value
        return func(*tree_map(whole, args), **tree_map(whole, kwargs or {}))

    def whole(self) -> torch.Tensor:
        raise NotImplementedError

    # Tensor methods that read the data without an op of their own (the dispatch never sees them).
    def numpy(self, *args, **kwargs):
        return self.whole().numpy(*args, **kwargs)

    def tolist(self):
        return self.whole().tolist()

    def __repr__(self, *args, **kwargs):
        return repr(self.whole())

    def __reduce_ex__(self, protocol):
        return self.whole().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.whole(), memo)


class LazyLogits(WholeOnRead):
    """The whole logits, gathered on first read (module docstring)."""

    @staticmethod
    def __new__(cls, shard: torch.Tensor, full: int, service: ShardService):
        shape = tuple(shard.shape[:-1]) + (full,)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=shard.dtype, device=shard.device,
                                                   requires_grad=False)

    def __init__(self, shard: torch.Tensor, full: int, service: ShardService):
        self.shard, self.full, self._service, self._whole = shard, full, service, None
        self.number = service.register(self)

    def whole(self) -> torch.Tensor:
        """The whole logits (a plain tensor, without autograd history), fetched once."""
        if self._whole is None:
            service = self._service
            shards = []
            for peer in range(len(service.addresses)):
                if peer == service.rank:
                    shards.append(self.shard)
                    continue
                shard = service.fetch(peer, self.number)
                if shard is None:
                    raise RuntimeError(
                        f"lazy logits: group rank {service.rank} of group {service.group!r} reads the model's "
                        f"logits (lazy output {self.number}), but group rank {peer} holds no shard of them: the "
                        f"ranks ran different forwards, or it did not make this output within the group's "
                        f"timeout. Run every forward on every rank of the group, or parallelize the model with "
                        f"logits='whole' (gathered on every forward)")
                shards.append(shard.to(self.shard.device))
            self._whole = torch.cat(shards, dim=-1)
        return self._whole


class _Lazy(torch.autograd.Function):
    """shard -> LazyLogits; the gradient of the whole logits -> this rank's slice of it."""

    @staticmethod
    def forward(ctx, shard, full, service):
        ctx.slice = _slice_of(full, len(service.addresses), service.rank)
        return LazyLogits(shard.detach(), full, service)

    @staticmethod
    def backward(ctx, grad):
        offset, length = ctx.slice
        return grad.narrow(-1, offset, length), None, None


def lazy_logits(shard: torch.Tensor, full: int, service: ShardService) -> torch.Tensor:
    """``shard`` (this rank's vocabulary slice of the logits) as lazy whole logits of ``full`` classes."""
    return _Lazy.apply(shard, full, service)
