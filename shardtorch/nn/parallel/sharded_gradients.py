"""Averages the gradients of sharded parameters over the data-parallel group,
for the hybrid layout, where a DDP over the world must leave them out.

In the hybrid layout every tensor-parallel group computes its own loss (the
mean over the group's gathered batch); a shard's gradient on one rank is the
gradient of its group's loss; the global loss is the mean of the M group
losses, and the ranks holding the same shard are exactly one data-parallel
group. So the exact gradient of a shard is its average over that group.

It follows DDP's rules, so that the two stay in step:
- whether a backward synchronises is decided at the forward of the DDP
  module (``require_backward_grad_sync``, which ``no_sync()`` clears), so
  gradient accumulation under ``no_sync`` accumulates locally and the first
  backward outside it averages the accumulated sum;
- the averaging runs once per backward, after every gradient of the pass has
  been accumulated (an autograd-engine callback), as one flat all-reduce per
  (device, dtype) in parameter order: the same collectives on every rank,
  whatever order the hooks fired in.
"""
from collections import OrderedDict
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ...distributed import collectives


class ShardedGradientAverager:
    """Hooks that average ``parameters``' gradients over ``group`` after each
    synchronising backward of ``ddp_module``.

    Args:
        ddp_module: the DistributedDataParallel whose forward decides, as for
            its own parameters, whether the next backward synchronises.
        parameters: the parameters to average (those DDP was told to ignore).
        group: the torch ProcessGroup to average over (the data-parallel group).
    """

    def __init__(self, ddp_module: nn.Module, parameters: Iterable[nn.Parameter],
                 group: dist.ProcessGroup) -> None:
        if not hasattr(ddp_module, "require_backward_grad_sync"):
            raise TypeError(f"ShardedGradientAverager: ddp_module must be a torch "
                            f"DistributedDataParallel, got {type(ddp_module).__name__}")
        unique = OrderedDict((id(p), p) for p in parameters if p.requires_grad)
        self.parameters: List[nn.Parameter] = list(unique.values())
        self.group = group
        self.group_size = dist.get_world_size(group)
        self._sync_next_backward = False
        self._callback_queued = False
        self._handles = [ddp_module.register_forward_pre_hook(self._on_forward)]
        self._handles += [p.register_post_accumulate_grad_hook(self._on_gradient_accumulated)
                          for p in self.parameters]

    def remove(self) -> None:
        """Removes the hooks (the DDP module keeps working for its own parameters)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_forward(self, ddp_module: nn.Module, args) -> None:
        # As DDP: a forward without grad (an evaluation between a training
        # forward and its backward) does not change what the backward does.
        if torch.is_grad_enabled():
            self._sync_next_backward = ddp_module.require_backward_grad_sync

    def _on_gradient_accumulated(self, parameter: nn.Parameter) -> None:
        if self._sync_next_backward and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average)

    @torch.no_grad()
    def _average(self) -> None:
        self._callback_queued = False
        self._sync_next_backward = False
        self.average_now()

    @torch.no_grad()
    def average_now(self, grads: Optional[List[torch.Tensor]] = None) -> None:
        """Averages the current gradients over the group (the hooks call it;
        call it yourself after a backward that bypassed the DDP forward)."""
        if self.group_size == 1:
            return
        grads = [p.grad for p in self.parameters if p.grad is not None] if grads is None else grads
        buckets = OrderedDict()
        for grad in grads:
            if grad.is_sparse:
                raise RuntimeError("ShardedGradientAverager: sparse gradients of sharded parameters "
                                   "are not supported")
            buckets.setdefault((grad.device, grad.dtype), []).append(grad)
        for bucket in buckets.values():
            flat = _flatten_dense_tensors(bucket)
            # Divide first, as DDP does, so that a float16 sum cannot overflow.
            flat.div_(self.group_size)
            collectives.all_reduce(flat, group=self.group)
            for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(averaged)
