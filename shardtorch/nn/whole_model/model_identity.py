"""What a model computes, as a digest: its modules (each one's class, attributes, parameters' and
buffers' shapes and dtypes, hooks), its config, and the Python code its forwards reach
(utils/code_identity.py). The proof's cache (proof_cache.py) keys a proven split by it, with the
plan and the options; the weights' values are not part of it (the proof checks how the split reads
weights, which does not depend on them, as a miniature's proof already assumes).

Attributes count by value where they are simple (a head count, a flag, a tuple of sizes), by class
otherwise; small buffers (rotary frequencies, masks) by their contents too.
"""
import functools
import hashlib
import types
from typing import List, Optional, Tuple

import torch
from torch import nn

from ...utils.code_identity import as_function, class_attribute, reachable_code_digest

#: Module internals described by their own parts (parameters, buffers, children, hooks) or not part of
#: what the module computes.
_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"})
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
#: Entries that name where a model came from, or only what generate reads, not what its forward
#: computes (a GenerationConfig also holds its own hash, which differs between processes).
_PROVENANCE = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "generation_config",
                         "_original_object_hash"})
#: Buffers up to this many elements count by their contents.
_SMALL_BUFFER = 1 << 16
_DEPTH = 6
_SKIPPED = _INTERNALS | _PROVENANCE | {"forward", "__call__"}
_SIMPLE = frozenset({bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size})
_FUNCTIONS = frozenset({types.FunctionType, types.MethodType, staticmethod, classmethod, property,
                        functools.partial})


class _Describer:
    def __init__(self):
        self.parts: List[str] = []  # hashed at the end, joined
        self.starts: List[Tuple[types.FunctionType, Optional[type]]] = []
        self.seen = {}
        self.classes = {}  # class -> its (forward, __call__) starts

    def text(self, value: str) -> None:
        self.parts.append(value)

    def value(self, value, depth: int = 0) -> None:
        """Simple values by repr; containers item by item; functions followed as code; modules, classes
        and other objects by class (objects with attributes, configs say, also by those, once each).
        Dispatched on type(), not isinstance: a config's __getattribute__ would answer each __class__."""
        kind = type(value)
        if kind in _SIMPLE:
            self.text(repr(value))
            return
        if kind in _FUNCTIONS:
            function = as_function(value)
            if function is not None:
                owner = type(value.__self__) if kind is types.MethodType else None
                self.starts.append((function, owner))
                self.text(f"function {function.__module__}.{function.__qualname__}")
                if kind is functools.partial:  # checkpoint(use_reentrant=...), say
                    self.value((value.args, value.keywords), depth + 1)
                return
        if issubclass(kind, torch.Tensor):
            self.tensor(value, contents=value.numel() <= _SMALL_BUFFER)
            return
        if issubclass(kind, (nn.Module, type)):
            self.text(f"{kind.__qualname__} {getattr(value, '__qualname__', '')}")
            return
        if id(value) in self.seen:
            self.text(f"seen {self.seen[id(value)]}")
            return
        if depth >= _DEPTH:
            self.text(kind.__qualname__)
            return
        self.seen[id(value)] = len(self.seen)
        if kind in (list, tuple):
            self.text(f"{kind.__qualname__}[{len(value)}]")
            for item in value:
                self.value(item, depth + 1)
        elif issubclass(kind, (set, frozenset)):
            self.text(f"{kind.__qualname__} " + repr(sorted(repr(v) for v in value)))
        elif issubclass(kind, dict):
            self.text(f"{kind.__qualname__}{{{len(value)}}}")
            for key in sorted(value, key=repr):
                if key in _PROVENANCE:
                    continue
                self.text(repr(key))
                self.value(value[key], depth + 1)
        else:
            self.text(f"{kind.__module__}.{kind.__qualname__}")
            try:
                attributes = object.__getattribute__(value, "__dict__")
            except (AttributeError, TypeError):
                attributes = None
            if type(attributes) is dict:
                self.value(attributes, depth + 1)

    def tensor(self, tensor: torch.Tensor, contents: bool) -> None:
        self.text(f"{tuple(tensor.shape)} {tensor.dtype} {tensor.device.type} {tensor.requires_grad}")
        if contents and tensor.device.type == "cpu" and not tensor.is_meta and tensor.layout == torch.strided:
            flat = tensor.detach().reshape(-1)
            flat = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.contiguous().view(torch.uint8)
            self.parts.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())

    def hooks(self, hooks) -> None:
        if hooks:
            for hook in hooks.values():
                self.value(hook)

    def class_starts(self, cls: type) -> list:
        starts = self.classes.get(cls)
        if starts is None:
            functions = [as_function(class_attribute(cls, name)) for name in ("forward", "__call__")]
            starts = self.classes[cls] = [(f, cls) for f in functions if f is not None]
        return starts


def _module(describer: _Describer, name: str, module: nn.Module) -> None:
    cls = type(module)
    describer.text(f"module {name} {cls.__module__}.{cls.__qualname__}")
    attributes = vars(module)
    if "forward" in attributes or "__call__" in attributes:
        for attribute in ("forward", "__call__"):
            if attribute in attributes:
                describer.text(f"instance {attribute}")
                describer.value(attributes[attribute])
    describer.starts.extend(describer.class_starts(cls))
    simple, other = [], []
    for key, value in attributes.items():
        if key in _SKIPPED:
            continue
        if type(value) in _SIMPLE:
            simple.append((key, value))
        else:
            other.append(key)
    describer.text(repr(sorted(simple)))  # the simple attributes (most of them) in one repr
    for key in sorted(other):
        describer.text(key)
        describer.value(attributes[key])
    for key in _HOOKS:
        describer.hooks(attributes.get(key))
    for pname, p in module._parameters.items():
        if p is not None:
            describer.text(f"parameter {pname}")
            describer.tensor(p, contents=False)
            describer.hooks(p._backward_hooks)
            describer.hooks(getattr(p, "_post_accumulate_grad_hooks", None))
    for bname, b in module._buffers.items():
        if b is not None:
            describer.text(f"buffer {bname} {bname in module._non_persistent_buffers_set}")
            describer.tensor(b, contents=b.numel() <= _SMALL_BUFFER)


def model_digest(model: nn.Module) -> bytes:
    """The digest of what ``model`` computes (module docstring)."""
    describer = _Describer()
    for name, module in model.named_modules(remove_duplicate=False):
        _module(describer, name, module)
    config = getattr(model, "config", None)
    if config is not None:
        describer.text("config")
        describer.value(config)
    from torch.nn.modules import module as torch_module
    for key in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                "_global_backward_hooks"):
        describer.hooks(getattr(torch_module, key, None))
    digest = hashlib.sha256("\0".join(describer.parts).encode())
    digest.update(reachable_code_digest(describer.starts))
    return digest.digest()
