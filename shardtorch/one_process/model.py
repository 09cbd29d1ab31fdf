"""TensorParallelModel: the caller's handle on a model split over devices, used as the unsharded
model is.

Its parameters are the ranks' own tensors, mapped into this process: every rank's slice of each
split parameter, and rank 0's copy of each replicated one (so ``sum(p.numel() for p in
model.parameters())`` and a gradient norm over them are the unsharded model's). An optimizer over
``model.parameters()`` updates the ranks' memory in place; each forward first copies rank 0's
replicated parameters to the other ranks. Their gradients are the ranks' gradient buffers, attached
after each backward to the parameters that took part (None stays None, as in torch).
"""
import inspect
import itertools
import weakref
from collections import OrderedDict
from typing import List, Optional

import torch
from torch import nn

from .pool import WorkerPool
from .remote_outputs import CallerStep, RemoteForward, RemoteLogits
from .structure import KeptObject, LazySlot, TensorSlot, map_structure


class _Holder(nn.Module):
    """A module that only holds parameters, so that a rank's parameters keep their dotted names."""

    def extra_repr(self) -> str:
        return ""

    def forward(self, *args, **kwargs):
        raise RuntimeError("tensor_parallel: this module only holds a rank's parameters; call the model")


_HOLDER_CLASSES: dict = {}


def _holder_of(kind: Optional[type]) -> nn.Module:
    """A _Holder, or for a norm layer's parameters one that is also an instance of the norm's class
    (without its constructor: it holds the parameters and nothing else)."""
    if kind is None:
        return _Holder()
    if kind not in _HOLDER_CLASSES:
        try:
            _HOLDER_CLASSES[kind] = type(kind.__name__, (_Holder, kind), {"__module__": __name__})
        except TypeError:
            _HOLDER_CLASSES[kind] = _Holder
    holder = _HOLDER_CLASSES[kind].__new__(_HOLDER_CLASSES[kind])
    nn.Module.__init__(holder)
    return holder


def _holder_tree(root: nn.Module, name: str, value: nn.Parameter, kinds: dict) -> None:
    *path, leaf = name.split(".")
    module = root
    for depth, part in enumerate(path):
        child = module._modules.get(part)
        if child is None:
            child = _holder_of(kinds.get(".".join(path[:depth + 1])))
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, value)


def _signature(parameters: list) -> Optional[inspect.Signature]:
    if not parameters:
        return None
    return inspect.Signature([inspect.Parameter(name, inspect._ParameterKind(kind),
                                                default=None if has_default else inspect.Parameter.empty)
                              for name, kind, has_default in parameters])


class TensorParallelModel(nn.Module):
    """The model on ``devices``, one rank per device (see ``shardtorch.tensor_parallel``)."""

    def __init__(self, pool: WorkerPool, source: Optional[nn.Module]):
        super().__init__()
        self._pool = pool
        self._closer = weakref.finalize(self, pool.close)
        self.devices = list(pool.devices)
        self.config = getattr(source, "config", None)
        self.generation_config = getattr(source, "generation_config", None)
        self._class_name = type(source).__name__ if source is not None else "model"
        self._dropped: List[int] = []
        self._steps = 0
        self._anchor = torch.zeros((), requires_grad=True)
        described = [entries for entries, *_ in pool.described]  # per rank: [(name, tensor, sharded, exposed,
        # requires_grad)]
        _, training, norm_classes, forward_parameters = pool.described[0]
        self._names = [entry[0] for entry in described[0]]
        self._sharded = [entry[2] for entry in described[0]]
        self._views: List[List[torch.Tensor]] = [[entry[1] for entry in ranks] for ranks in described]
        self._grad_views: List[dict] = [{} for _ in described]  # per rank: {parameter index: its gradient buffer}
        self.shards = nn.ModuleList()
        # Per rank: {parameter index: the caller's Parameter on the rank's memory}.
        self._parameters_of: List[dict] = []
        for rank, ranks in enumerate(described):
            holder, mine = _Holder(), {}
            for index, (name, tensor, sharded, exposed, requires_grad) in enumerate(ranks):
                if exposed:
                    mine[index] = nn.Parameter(tensor, requires_grad=requires_grad)
                    _holder_tree(holder, name, mine[index], norm_classes)
            self.shards.append(holder)
            self._parameters_of.append(mine)
        self.train(training)  # the mode the model was in (from_pretrained returns it in eval)
        # Where each rank's parameters are: Trainer and Accelerate then leave the placement alone
        # instead of calling .to() (which a TensorParallelModel refuses).
        self.hf_device_map = {f"shards.{rank}": str(device) for rank, device in enumerate(self.devices)}
        this = weakref.ref(self)

        def forward(*args, **kwargs):
            return TensorParallelModel.forward(this(), *args, **kwargs)
        signature = _signature(forward_parameters)
        if signature is not None:  # forward takes the model's own signature (Trainer reads it)
            forward.__signature__ = signature
        # torch.compile runs it as it is, between graphs: its work is the ranks', and tracing the
        # commands to them (pipes, finalizers) fails inside dynamo.
        self.forward = torch.compiler.disable(forward)

    # -- what the caller sees ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.devices[0]

    @property
    def dtype(self) -> torch.dtype:
        floating = [t.dtype for t in self._views[0] if t.is_floating_point()]
        return floating[0] if floating else torch.get_default_dtype()

    def __repr__(self) -> str:
        # One line, not a module tree: the holders of each rank's parameters are not the model's layers.
        count = sum(p.numel() for p in self.parameters())
        state = "closed" if self._pool.closed else ("broken" if self._pool.broken else "ready")
        return (f"TensorParallelModel({self._class_name} over {[str(d) for d in self.devices]}, {count:,} parameters, "
                f"{state})")

    def close(self) -> None:
        """Stops the workers and frees their devices (also done when the model is garbage collected
        and at exit). The model cannot be used afterwards."""
        self._closer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce_ex__(self, protocol):
        raise TypeError("tensor_parallel: a TensorParallelModel is a handle on its worker processes and does not "
                        "pickle or copy; save model.state_dict() (whole tensors) or model.save_pretrained(...)")

    def __deepcopy__(self, memo):
        self.__reduce_ex__(2)

    def _apply(self, fn, recurse=True):
        raise RuntimeError("tensor_parallel: the model's slices live on its devices; .to(), .cuda(), .half() "
                           "and the like are not supported on it. Convert the model before tensor_parallel, or "
                           "pass dtype= to from_pretrained")

    # -- commands -------------------------------------------------------------------------------
    def _run(self, command: str, payload, ranks=None) -> list:
        """``command`` on ``ranks`` (all by default). The steps the caller has dropped since the last
        command to every rank go with this one when it goes to every rank (a fetch goes to rank 0
        only: they wait for the next)."""
        drops = []
        while ranks is None and self._dropped:  # pop by pop: a finalizer may append meanwhile
            drops.append(self._dropped.pop())
        payloads = [dict(p, drop=drops) for p in payload] if isinstance(payload, list) else dict(payload, drop=drops)
        if self.devices[0].type == "cuda":
            for device in self.devices:
                torch.cuda.synchronize(device)  # the caller's optimizer wrote the ranks' memory
        return self._pool.run(command, payloads, ranks)

    def _sync_replicated(self) -> None:
        """Rank 0's replicated parameters (the ones the optimizer updates) to the other ranks."""
        with torch.no_grad():
            for index, sharded in enumerate(self._sharded):
                if not sharded:
                    for rank in range(1, len(self._views)):
                        self._views[rank][index].copy_(self._views[0][index])

    def _requires_grad(self) -> List[bool]:
        """Per parameter, whether it trains (rank 0's flag: it holds every parameter)."""
        return [self._parameters_of[0][index].requires_grad for index in range(len(self._names))]

    def _inputs(self, args, kwargs):
        """(args, kwargs) to send, and the input tensors that want gradients (in send order)."""
        wanting, counter, positions = [], itertools.count(), []

        def tensor(value):
            position = next(counter)
            if value.requires_grad and torch.is_grad_enabled():
                wanting.append(value)
                positions.append(position)
            return value.detach()

        def other(value):
            return value
        sent = map_structure((args, kwargs), tensor, other)
        return sent, wanting, positions

    def forward(self, *args, **kwargs):
        self._pool.check_usable()
        self._sync_replicated()
        (args, kwargs), wanting, positions = self._inputs(args, kwargs)
        grad_enabled = torch.is_grad_enabled()
        device_type = self.devices[0].type
        autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        payload = dict(args=args, kwargs=kwargs, grad_inputs=positions, grad_enabled=grad_enabled,
                       training=self.training, autocast=autocast, requires_grad=self._requires_grad())
        holder = {}

        def call():
            step, structure, outputs, differentiable = self._remote_step("forward", payload)
            holder.update(structure=structure, step=step)
            return step, outputs, differentiable

        if grad_enabled:
            outputs = RemoteForward.apply(call, self._anchor, *wanting)
        else:
            outputs = call()[1]
        return self._rebuild(holder["structure"], outputs, holder["step"])

    def _remote_step(self, command: str, payload: dict):
        """``command`` (forward or generate) as a new step on every rank: (its CallerStep, rank 0's
        output structure, its tensors with lazy logits as RemoteLogits, which are differentiable)."""
        self._steps += 1
        number = self._steps
        structure, items, differentiable = self._run(command, dict(payload, step=number))[0]
        step = CallerStep(number, self._fetch, self._backward, self._dropped)
        outputs = [RemoteLogits(step, item.index, item.shape, item.dtype, self.devices[0])
                   if isinstance(item, LazySlot) else item for item in items]
        return step, structure, outputs, differentiable

    def _rebuild(self, structure, outputs, step: CallerStep):
        def other(value):
            if isinstance(value, TensorSlot):
                return outputs[value.index]
            if isinstance(value, KeptObject):
                return _KeptHandle(value.step, value.index, step)
            return value
        return map_structure(structure, lambda t: t, other)

    def _fetch(self, number: int, index: int) -> torch.Tensor:
        return self._run("fetch", dict(step=number, index=index), ranks=[0])[0]

    def _backward(self, number: int, grads) -> list:
        grads = [None if g is None else g.detach() for g in grads]
        payloads = [dict(step=number, grads=grads, reset=self._resets(rank)) for rank in range(len(self.devices))]
        replies = self._run("backward", payloads)
        for rank, (_, participated, new_buffers) in enumerate(replies):
            self._grad_views[rank].update(new_buffers)
            took_part = set(participated)
            for index, param in self._parameters_of[rank].items():
                view = self._grad_views[rank].get(index)
                if view is not None and (param.grad is view or index in took_part):
                    param.grad = view
        return replies[0][0]

    def _resets(self, rank: int) -> List[int]:
        """The parameters whose gradient starts afresh on this rank (None here, after zero_grad): the rank
        copies its new gradient into their buffers instead of adding to them; a gradient the caller set
        itself is copied into the buffer first."""
        reset = []
        for index, param in self._parameters_of[rank].items():
            view = self._grad_views[rank].get(index)
            if view is None:
                continue  # no buffer yet: the rank's first backward fills a new one
            if param.grad is None:
                reset.append(index)
            elif param.grad is not view:
                with torch.no_grad():
                    view.copy_(param.grad)
                param.grad = view
        return reset

    def generate(self, *args, **kwargs):
        """``generate`` of the model on every rank; rank 0's result (the unsharded model's tokens)."""
        self._pool.check_usable()
        if kwargs.get("streamer") is not None:
            raise ValueError("tensor_parallel: generate(streamer=...) is not supported: the tokens are made in "
                             "the workers. Call generate without a streamer and decode its result")
        self._sync_replicated()
        (args, kwargs), _, _ = self._inputs(args, kwargs)
        step, structure, outputs, _ = self._remote_step("generate", dict(
            args=args, kwargs=kwargs, training=self.training, requires_grad=self._requires_grad()))
        return self._rebuild(structure, outputs, step)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The unsharded model's state dict (whole tensors, the unsharded model's keys), gathered by
        the ranks."""
        self._pool.check_usable()
        self._sync_replicated()
        whole = self._run("state_dict", {})[0]
        result = OrderedDict() if destination is None else destination
        for key, value in whole.items():
            result[prefix + key] = value
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads the unsharded model's state dict: each rank takes its slices."""
        self._pool.check_usable()
        payloads = [dict(state_dict=dict(state_dict) if rank == 0 else None, strict=strict)
                    for rank in range(len(self.devices))]
        missing, unexpected = self._run("load_state_dict", payloads)[0]
        return nn.modules.module._IncompatibleKeys(list(missing), list(unexpected))

    def save_pretrained(self, *args, **kwargs) -> None:
        """The model's ``save_pretrained``: the unsharded model's checkpoint, written by the ranks."""
        self._pool.check_usable()
        self._sync_replicated()
        self._run("save_pretrained", dict(args=args, kwargs=kwargs))


class _KeptHandle(KeptObject):
    """A KeptObject that holds its step (so that the ranks keep the object while it lives)."""

    def __init__(self, step_number: int, index: int, step: CallerStep):
        super().__init__(step_number, index)
        object.__setattr__(self, "_step", step)

    def __reduce__(self):
        return KeptObject, (self.step, self.index)
