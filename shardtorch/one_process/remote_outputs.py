"""What a forward on the workers gives the caller: its outputs, joined to the caller's autograd.

``RemoteForward`` runs the forward on every rank and returns rank 0's outputs; its backward sends
the outputs' gradients to every rank, which runs backward through its own graph (the same
collectives as under torchrun), and returns the gradients of the caller's inputs. The parameters'
gradients do not pass through here: each rank accumulates them into buffers the caller maps
(model.py attaches them to the caller's parameters).

``RemoteLogits`` stands for lazy whole logits that rank 0 keeps (``logits="lazy"``, the default):
the first read fetches them from rank 0 (which gathers the other ranks' shards through their shard
services, see nn/whole_model/lazy_logits.py), so a step that reads only the loss moves no logits.
"""
import weakref

import torch

from ..nn.whole_model.lazy_logits import WholeOnRead


class CallerStep:
    """One forward or generate on the workers, kept there while this object lives."""

    def __init__(self, number: int, fetch, backward, dropped: list):
        self.number, self._fetch, self._backward = number, fetch, backward
        weakref.finalize(self, dropped.append, number).atexit = False

    def fetch(self, index: int) -> torch.Tensor:
        return self._fetch(self.number, index)

    def backward(self, grads):
        return self._backward(self.number, grads)


class RemoteLogits(WholeOnRead):
    """Whole logits that rank 0 keeps, fetched on first read (module docstring)."""

    @staticmethod
    def __new__(cls, step: CallerStep, index: int, shape, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    def __init__(self, step: CallerStep, index: int, shape, dtype, device):
        self.step, self.index, self._whole = step, index, None

    def whole(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = self.step.fetch(self.index)
        return self._whole


class RemoteForward(torch.autograd.Function):
    """(call, anchor, *inputs wanting gradients) -> rank 0's output tensors (module docstring).

    ``call()`` runs the forward on the workers and returns (its CallerStep, the output tensors, which
    of them are differentiable). ``anchor`` is a scalar that requires grad, so that the outputs join
    the caller's graph even when no input wants a gradient (token ids)."""

    @staticmethod
    def forward(ctx, call, anchor, *inputs):
        step, outputs, differentiable = call()
        ctx.step = step
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[out for out, flag in zip(outputs, differentiable) if not flag])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        input_grads = ctx.step.backward(list(grads))
        return (None, None) + tuple(input_grads)
