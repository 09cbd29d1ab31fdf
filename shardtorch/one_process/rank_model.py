"""A worker's rank: its slice of the model and the commands the caller sends it.

Every rank runs every command (forward, backward, generate, state_dict, ...) as a torchrun rank
would run the same line of a script; rank 0's result is the one the caller returns. Parameters and
their gradient buffers live in memory the caller maps too (CPU shared memory, CUDA IPC), so the
caller's optimizer updates them in place and nothing is copied per step.
"""
import datetime
import inspect
import itertools
import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

import shardtorch as ts
from ..distributed import collectives
from ..nn.whole_model.lazy_logits import LazyLogits
from .structure import KeptObject, LazySlot, TensorSlot, map_structure
from .wire import share_memory


class _Step:
    """What a rank keeps of one forward or generate call until the caller drops it."""
    __slots__ = ("outputs", "inputs", "lazy", "objects")

    def __init__(self):
        self.outputs: List[torch.Tensor] = []   # its output tensors, with their graph
        self.inputs: List[torch.Tensor] = []    # the inputs the caller wants gradients of
        self.lazy: Dict[int, LazyLogits] = {}
        self.objects: Dict[int, object] = {}


class RankModel:
    def __init__(self, rank: int, world: int, store_port: int, device: str, threads: int, build: dict,
                 stop_flag: torch.Tensor, timeout_s: float):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.stop_flag = stop_flag
        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        ts.distributed.init_process_group(group_size=world, timeout=timeout)
        self.model = self._build(**build)
        self.params = list(self.model.named_parameters())
        self.layout = self._sharded_names()
        self.exposed = [rank == 0 or name in self.layout for name, _ in self.params]
        self.grad_buffers: Dict[int, torch.Tensor] = {}
        self.participated = set()
        self.steps: Dict[int, _Step] = {}

    # -- building -------------------------------------------------------------------------------
    def _build(self, how: str, model=None, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if how == "parallelize":
            built = ts.nn.parallelize(model, **kwargs)
            return built.to(self.device) if self.device.type != "cpu" else built
        kwargs.setdefault("device", str(self.device))
        return ts.nn.from_pretrained(*args, **kwargs)

    def _sharded_names(self) -> set:
        from ..checkpoint.layout import model_layout
        return {key for key, entry in model_layout(self.model).items() if entry.sharded}

    def describe(self) -> list:
        """([(name, the parameter in memory the caller can map, sharded, exposed, requires_grad)], whether
        the model is in training mode, its norm layers' classes, its forward's parameters); the
        parameters in a fixed order:
        the split parameters of every rank and rank 0's copy of each replicated one are what the
        caller's ``parameters()`` lists."""
        described = []
        for (name, param), exposed in zip(self.params, self.exposed):
            if self.device.type == "cpu":
                share_memory(param)
            described.append((name, param.detach(), name in self.layout, exposed, param.requires_grad))
        return described, self.model.training, self._norm_classes(), self._forward_parameters()

    def _norm_classes(self) -> dict:
        """{module name: class} of the normalisation layers that hold parameters: the caller's holders of
        their parameters are of the same class, so that code that tells norms by type (Hugging Face's
        Trainer, which exempts them from weight decay) sees them as the unsharded model's."""
        kinds = tuple(k for k in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if k is not None)
        return {name: type(module) for name, module in self.model.named_modules()
                if name and isinstance(module, kinds) and any(True for _ in module.parameters(recurse=False))}

    def _forward_parameters(self) -> list:
        """[(name, kind, has a default)] of the model's forward: the caller's forward takes its signature
        (Trainer keeps the dataset columns that the forward names)."""
        try:
            signature = inspect.signature(self.model.forward)
        except (TypeError, ValueError):
            return []
        return [(p.name, int(p.kind), p.default is not inspect.Parameter.empty) for p in signature.parameters.values()]

    # -- commands -------------------------------------------------------------------------------
    def run(self, command: str, payload):
        for step in payload.pop("drop", ()):
            self.steps.pop(step, None)
        result = getattr(self, "_" + command)(**payload)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the caller reads the results and the shared gradients next
        return result

    def _open_step(self, number: int, args, kwargs, grad_inputs, training: bool, requires_grad):
        """A forward's or generate's start: the caller's flags and mode applied, its step kept under
        ``number``, its inputs on this rank's device (those the caller wants gradients of marked)."""
        self._set_requires_grad(requires_grad)
        if self.model.training != training:
            self.model.train(training)
        step = self.steps[number] = _Step()
        positions = itertools.count()
        wanted = set(grad_inputs)

        def tensor(value):
            value = value.to(self.device)
            if next(positions) in wanted:
                value = value.detach().requires_grad_(True)
                step.inputs.append(value)
            return value

        def other(value):
            if isinstance(value, KeptObject):
                return self.steps[value.step].objects[value.index]
            return value
        return map_structure((args, kwargs), tensor, other)

    def _outputs(self, number: int, value):
        """Rank 0: (the output with its tensors as slots, per slot the tensor or a LazySlot, which
        slots are differentiable); other ranks keep theirs and return None."""
        step = self.steps[number]

        def tensor(value):
            if isinstance(value, LazyLogits):
                step.lazy[len(step.outputs)] = value
            step.outputs.append(value)
            return TensorSlot(len(step.outputs) - 1)

        def other(value):
            step.objects[len(step.objects)] = value
            return KeptObject(number, len(step.objects) - 1)
        structure = map_structure(value, tensor, other)
        if self.rank != 0:
            return None
        items = [LazySlot(index, tuple(t.shape), t.dtype) if isinstance(t, LazyLogits) else t.detach()
                 for index, t in enumerate(step.outputs)]
        return structure, items, [t.requires_grad for t in step.outputs]

    def _set_requires_grad(self, requires_grad):
        if requires_grad is not None:
            for (_, param), flag in zip(self.params, requires_grad):
                param.requires_grad_(flag)

    def _forward(self, step: int, args, kwargs, grad_inputs=(), grad_enabled=True, training=True,
                 autocast=None, requires_grad=None):
        args, kwargs = self._open_step(step, args, kwargs, grad_inputs, training, requires_grad)
        with torch.set_grad_enabled(grad_enabled), self._autocast(autocast):
            out = self.model(*args, **kwargs)
        return self._outputs(step, out)

    def _autocast(self, autocast):
        enabled, dtype = autocast or (False, None)
        return torch.autocast(self.device.type, dtype=dtype, enabled=enabled)

    def _backward(self, step: int, grads, reset):
        kept = self.steps[step]
        if kept.outputs is None:
            raise RuntimeError("one_process: this output's backward has run already; the ranks keep no graph "
                               "for a second one (retain_graph=True is not supported through the workers)")
        new_buffers = self._prepare_gradients(reset)
        pairs = [(t, g.to(self.device)) for t, g in zip(kept.outputs, grads) if g is not None and t.requires_grad]
        self.participated = set()
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        input_grads = [t.grad for t in kept.inputs] if self.rank == 0 else None
        kept.outputs, kept.inputs = None, None
        for index, ((_, param), exposed) in enumerate(zip(self.params, self.exposed)):
            if not exposed:
                param.grad = None  # a replicated parameter's other copies: rank 0's gradient is the one
        return input_grads, sorted(self.participated), new_buffers

    def _prepare_gradients(self, reset):
        """Each exposed trainable parameter's gradient ends the backward in its buffer (made and shared
        when the parameter first trains), the memory the caller maps. A parameter whose caller-side
        gradient is None (``reset``, after ``zero_grad``) starts from None, so that autograd keeps the
        gradient it computed and the hook copies it in once (no zeroing, no addition); any other
        accumulates into its buffer in place. Returns the new buffers {index: buffer}."""
        new = {}
        for index, ((_, param), exposed) in enumerate(zip(self.params, self.exposed)):
            if exposed and param.requires_grad and index not in self.grad_buffers:
                buffer = torch.empty_like(param, memory_format=torch.contiguous_format)
                if buffer.device.type == "cpu":
                    share_memory(buffer)
                param.register_post_accumulate_grad_hook(lambda p, index=index: self._accumulated(index, p))
                self.grad_buffers[index] = new[index] = buffer
        starting = set(reset) | set(new)
        for index, buffer in self.grad_buffers.items():
            self.params[index][1].grad = None if index in starting else buffer
        return new

    def _accumulated(self, index: int, param) -> None:
        self.participated.add(index)
        buffer = self.grad_buffers[index]
        if param.grad is not buffer:
            buffer.copy_(param.grad)
            param.grad = buffer

    def _configs(self):
        return getattr(self.model, "config", None), getattr(self.model, "generation_config", None)

    def _fetch(self, step: int, index: int):
        return self.steps[step].lazy[index].whole()

    def _generate(self, step: int, args, kwargs, training=False, requires_grad=None):
        from transformers import StoppingCriteriaList
        args, kwargs = self._open_step(step, args, kwargs, (), training, requires_grad)
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(_CallerStop(self.stop_flag))
        with torch.no_grad():
            out = self.model.generate(*args, stopping_criteria=criteria, **kwargs)
        return self._outputs(step, out)

    def _state_dict(self):
        from ..checkpoint import collect_state_dict
        return collect_state_dict(self.model, self.model.state_dict(), dst=0)

    def _load_state_dict(self, state_dict, strict=True):
        from ..checkpoint import relocate_state_dict
        local = relocate_state_dict(self.model, state_dict if self.rank == 0 else None, src=0)
        result = self.model.load_state_dict(local, strict=strict)
        return tuple(result.missing_keys), tuple(result.unexpected_keys)

    def _save_pretrained(self, args, kwargs):
        self.model.save_pretrained(*args, **kwargs)

    def close(self):
        self.steps.clear()
        if ts.distributed.is_initialized():
            ts.distributed.destroy_process_group()
        if dist.is_initialized():
            dist.destroy_process_group()


class _CallerStop:
    """Ends ``generate`` at the same token on every rank once the caller asks (Ctrl-C): the flag is
    read at different moments on each rank, so the ranks take its maximum over the group."""

    def __init__(self, flag: torch.Tensor):
        self.flag = flag

    def __call__(self, input_ids, scores, **kwargs):
        stop = self.flag.clone().to(torch.int64)
        collectives.all_reduce(stop, op="max", group=ts.distributed.get_group())
        return torch.full((input_ids.shape[0],), bool(stop.item()), dtype=torch.bool, device=input_ids.device)
