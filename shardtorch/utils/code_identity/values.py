"""Values as the proof's key describes them (``Description``): simple ones by repr, tensors and arrays
by shape, dtype and contents (a large buffer by a sample), containers item by item, modules by class,
attributes, parameter shapes, ties and hooks, other objects by class and attributes, the values classes
define; functions met are handed to the walk."""
import argparse
import functools
import hashlib
import os
import types
from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .bytecode import PROVENANCE, _BUILTIN, _CONSTRUCTORS, _DEPTH, _HOOKS, _MODULE_SKIPPED, _REGISTRY_LIMIT, _SIMPLE, _SMALL, _constant, _named, as_function, method_of, own_methods
from .files import _class_file, _file_stamp, _installed_class, _library_class, installed_file


_DEVICE_TYPES: Dict[torch.device, str] = {}
#: What a library object holds that is described item by item: containers and plain namespaces.
_HELD_BY_VALUE = (tuple, list, dict, set, frozenset, types.SimpleNamespace, argparse.Namespace)
#: Class attributes that are not values: classes, modules, builtins and descriptors (the walk follows
#: what code names of them).
_NOT_VALUES = (type, types.ModuleType, property, staticmethod, classmethod, types.MemberDescriptorType,
               types.GetSetDescriptorType) + _BUILTIN


class TooDeep(ValueError):
    """A value nested deeper than the key describes."""


class Description:
    """Values as text parts (hashed by the caller), and the functions they lead to (``starts``)."""

    #: An object a module holds has every method of its class's own file followed (``self.layout.split()``);
    #: the walk, meeting objects in globals, follows only what code names.
    follows_held_classes = True

    def __init__(self):
        self.parts: List[str] = []
        self.starts: List[Tuple[types.FunctionType, Optional[type]]] = []
        self.seen: Dict[int, tuple] = {}  # id -> (number, the value itself)
        self.parameters: Dict[int, tuple] = {}  # id -> (number, the parameter), in the order described
        self.valued = set()  # classes whose values are described
        self.classes = set()

    def text(self, value: str) -> None:
        self.parts.append(value)

    def follow(self, function: types.FunctionType, owner: Optional[type]) -> None:
        self.starts.append((function, owner))

    def checked(self, value) -> None:
        """A mutable value read by the code (the walk snapshots it)."""

    def value(self, value, depth: int = 0, names: Tuple[str, ...] = ()) -> None:
        kind = type(value)
        if kind in _SIMPLE:
            self.parts.append(_constant(value) if kind is int else repr(value))
            return
        if value is os.environ:  # `from os import environ`
            self.environment(names)
            return
        function = as_function(value)
        if function is not None:
            owner = None
            if kind is types.MethodType and not issubclass(type(value.__self__), type):
                owner = type(value.__self__)
            self.parts.append("function " + _named(function))
            self.follow(function, owner)
            if issubclass(kind, functools.partial):
                self.value((value.args, value.keywords), depth + 1)
            elif kind is types.MethodType and owner is not None:
                self.value(value.__self__, depth + 1)
            return
        # Dispatched on type(value) with issubclass: a config's __getattribute__ would answer isinstance's
        # __class__ lookups, slowly.
        if issubclass(kind, _BUILTIN):
            self.parts.append("builtin " + _named(value))
            return
        # Modules and classes before the seen-check: what is read of them depends on the names of the code
        # that reads them.
        if issubclass(kind, types.ModuleType):  # transformers' lazy modules are subclasses
            self.parts.append("module " + str(value.__name__))
            self.module_attributes(value, names, 0)
            return
        if issubclass(kind, type):
            self.parts.append("class " + _named(value))
            self.klass(value, names)
            return
        if id(value) in self.seen:
            self.parts.append(f"seen {self.seen[id(value)][0]}")
            return
        if depth > _DEPTH:  # a value the key cannot hold whole: parallelize proves every time
            raise TooDeep(f"{kind.__qualname__} nested more than {_DEPTH} deep")
        self.seen[id(value)] = (len(self.seen), value)  # held: a temporary's id is not reused meanwhile
        self.checked(value)
        if issubclass(kind, nn.Module):
            self.module(None, value, depth)
        elif issubclass(kind, torch.Tensor):
            self.tensor(value, contents=True)
        elif issubclass(kind, functools.partial):  # of a builtin
            self.parts.append("partial")
            self.value((value.func, value.args, value.keywords), depth + 1)
        elif issubclass(kind, (list, tuple)):
            self.parts.append(f"{_named(kind)}[{len(value)}]")
            simple = []  # runs of simple items, each run in one repr
            for item in value:
                if type(item) in _SIMPLE:
                    simple.append(item)
                    continue
                self.simple_run(simple)
                self.value(item, depth + 1)
            self.simple_run(simple)
        elif issubclass(kind, dict):
            self.parts.append(f"{_named(kind)}{{{len(value)}}}")
            simple = []
            for key, item in list(dict.items(value)):
                if type(key) is str and key in PROVENANCE:
                    continue
                if type(key) in _SIMPLE and type(item) in _SIMPLE:
                    simple.append((key, item))
                    continue
                self.simple_run(simple)
                self.value(key, depth + 1)
                self.value(item, depth + 1, names)
            self.simple_run(simple)
        elif issubclass(kind, (set, frozenset)):
            self.parts.append(f"{_named(kind)}" + repr(sorted(self.apart(item, depth + 1) for item in value)))
        elif issubclass(kind, Mapping):
            self.registry(value, depth)
        else:
            self.instance(value, kind, depth, names)

    def simple_run(self, items: list) -> None:
        """Consecutive simple items of a container (a config's sizes, a plan's styles) in one part; emptied."""
        if items:
            try:
                self.parts.append("items " + repr(items))
            except ValueError:  # an int past repr's 4,300 digits: item by item (hex)
                self.parts.append("items")
                for item in items:
                    self.value(item, 1)
            items.clear()

    def environment(self, names: Tuple[str, ...]) -> None:
        """The variables of the environment the code names (in upper case: ``os.environ.get("FLAG")``), by
        value, or unset."""
        for name in names:
            if name.isupper():
                found = os.environ.get(name)
                self.environment_read(name, found)
                if found is not None:
                    self.parts.append(f"environ {name}={found!r}")

    def environment_read(self, name: str, found: Optional[str]) -> None:
        """A variable of the environment read (the walk checks it still holds before reusing itself)."""

    def apart(self, value, depth: int) -> str:
        """``value``'s description as one string (for sorting a set's items)."""
        parts, self.parts = self.parts, []
        try:
            self.value(value, depth)
            return "|".join(self.parts)
        finally:
            self.parts = parts

    def registry(self, mapping: Mapping, depth: int) -> None:
        try:
            entries, size = list(mapping.items())[:_REGISTRY_LIMIT], len(mapping)
        except Exception:  # noqa: BLE001 - a mapping that cannot list itself: by class
            entries, size = [], None
        self.parts.append(f"registry {_named(type(mapping))} {size}")
        for key, item in entries:
            self.value(key, depth + 1)
            self.value(item, depth + 1)

    def instance(self, value, kind: type, depth: int, names: Tuple[str, ...]) -> None:
        self.parts.append("object " + _named(kind))
        if kind.__module__ == "numpy" or kind.__name__ == "ndarray":
            self.array(value)
            return
        code = getattr(value, "code", None) if issubclass(kind, torch.jit.ScriptFunction) else None
        if isinstance(code, str):  # a scripted function: its TorchScript
            self.parts.append(code)
        try:
            wrapped = object.__getattribute__(value, "__wrapped__")  # functools.lru_cache, wraps
        except AttributeError:
            wrapped = None
        if wrapped is not None:
            self.value(wrapped, depth + 1)
        if _library_class(kind):  # torch's or Python's: by class and simple attributes (a Namespace's flags,
            self.plain_attributes(value, depth)  # a BlockMask's mask_mod, a custom op's functions)
            return
        self.klass(kind, names, own=self.follows_held_classes)  # what a module holds: all its methods
        try:
            attributes = object.__getattribute__(value, "__dict__")
        except Exception:  # noqa: BLE001 - no __dict__, or a property that raises
            attributes = None
        if type(attributes) is dict:
            self.value(attributes, depth + 1)
        for klass in kind.__mro__:
            slots = vars(klass).get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if slot not in ("__dict__", "__weakref__"):
                    self.parts.append("slot " + slot)
                    self.value(getattr(value, slot, None), depth + 1)

    def plain_attributes(self, value, depth: int) -> None:
        """An object's attributes that are simple values (by repr), functions (followed), containers and
        namespaces (item by item); other objects by class: what a library object holds that decides what
        code computes."""
        try:
            attributes = object.__getattribute__(value, "__dict__")
        except Exception:  # noqa: BLE001
            attributes = None
        items = list(dict.items(attributes)) if type(attributes) is dict else []
        for klass in type(value).__mro__:
            slots = vars(klass).get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if slot not in ("__dict__", "__weakref__"):
                    items.append((slot, getattr(value, slot, None)))
        if issubclass(type(value), (type, types.ModuleType)):
            return
        for key, item in items:
            kind = type(item)
            if kind in _SIMPLE or as_function(item) is not None or issubclass(kind, _BUILTIN):
                self.parts.append(str(key))
                self.value(item, depth + 1)
            elif issubclass(kind, _HELD_BY_VALUE):  # a Namespace's dict of flags, a nested namespace
                self.parts.append(str(key))
                self.value(item, depth + 1)
            else:
                self.parts.append(f"{key}: {_named(kind)}")

    def klass(self, cls: type, names: Tuple[str, ...], own: bool = False) -> None:
        """A class the code meets: its constructors and __call__, and the methods ``names`` names, followed;
        with ``own``, every method of its own file too (an object a module holds: self.layout.split())."""
        if _library_class(cls):
            return
        self.class_values(cls)
        if own and cls not in self.classes and not _installed_class(cls):
            self.classes.add(cls)
            for function in own_methods(cls):
                self.follow(function, cls)
        for name in _CONSTRUCTORS + names:
            definition, found = method_of(cls, name)
            if found is not None:
                self.bound(cls, name, definition)
                self.follow(found, cls)

    def bound(self, cls: type, name: str, definition) -> None:
        """A method found in ``cls`` (the walk checks it is still there before reusing itself)."""

    def module_attributes(self, module: types.ModuleType, names: Tuple[str, ...], depth: int) -> None:
        """The values of ``module`` under names the code uses, and of its submodules so named
        (``nn.functional.silu``), never by getattr: a lazy module would import on it (the walk's)."""

    def module(self, name: Optional[str], module: nn.Module, depth: int = 0) -> None:
        """An nn.Module: its class (whose forward, __call__ and own-file methods are followed), its
        attributes (simple ones in one repr), hooks, parameters' and buffers' shapes and dtypes, small
        buffers' values; its children too when it is met as a value (an unregistered module), not by
        name from named_modules."""
        cls = type(module)
        parts = self.parts
        parts.append(f"module {name} {_named(cls)}")
        if cls not in self.classes:
            self.module_class(cls)
        attributes = vars(module)
        simple, other = [], []
        for key in sorted(attributes.keys() - _MODULE_SKIPPED):  # the internals skipped in one set operation
            value = attributes[key]
            kind = type(value)
            if kind in _SIMPLE:
                simple.append((key, _constant(value) if kind is int else repr(value)))
            else:
                other.append(key)
        parts.append(repr(simple))
        for key in other:
            parts.append(key)
            self.value(attributes[key], depth + 1)
        for key in _HOOKS:
            hooks = attributes.get(key)
            if hooks:
                self.hooks(hooks, depth)
        for pname, p in module._parameters.items():
            if p is not None:
                tied = self.parameters.get(id(p))
                if tied is not None:  # the same tensor as an earlier module's (a tied head)
                    parts.append(f"parameter {pname} tied {tied[0]}")
                    continue
                self.parameters[id(p)] = (len(self.parameters), p)
                parts.append("parameter " + pname)
                self.tensor(p, contents=False)
                if p._backward_hooks:
                    self.hooks(p._backward_hooks, depth)
                if getattr(p, "_post_accumulate_grad_hooks", None):
                    self.hooks(p._post_accumulate_grad_hooks, depth)
        for bname, b in module._buffers.items():
            if b is not None:
                parts.append(f"buffer {bname} {bname in module._non_persistent_buffers_set}")
                self.tensor(b, contents=True)
        if name is None:
            for child_name, child in module._modules.items():
                if child is not None:
                    parts.append("child " + child_name)
                    self.value(child, depth + 1)

    def hooks(self, hooks, depth: int) -> None:
        if hooks:
            for hook in list(hooks.values()):
                self.value(hook, depth + 1)

    def module_class(self, cls: type) -> None:
        if cls in self.classes:
            return
        self.classes.add(cls)
        self.class_values(cls)
        for attribute in ("forward", "__call__"):
            function = method_of(cls, attribute)[1]
            if function is not None:
                self.follow(function, cls)
        if not _library_class(cls) and not _installed_class(cls):  # a script's, a notebook's, a checkout's
            for function in own_methods(cls):
                self.follow(function, cls)

    def class_values(self, cls: type) -> None:
        """The values ``cls`` and its classes define, other than methods, classes and descriptors (head
        counts, flags, enum members, tuples of names: what a layout or a forward may read through an
        instance, ``self.num_heads``, ``config.num_heads``), whether or not
        code names them, and its name as ``type(m).__name__`` gives it. Torch's and Python's classes are
        left out; an installed package's count by their file's stamp (an edit; its hundreds of attributes
        are not read each time). Each class once."""
        if cls.__name__ != cls.__qualname__.rpartition(".")[2]:
            self.parts.append("named " + cls.__name__)
        for klass in cls.__mro__:
            if klass in self.valued or _library_class(klass):
                continue
            self.valued.add(klass)
            file = _class_file(klass)
            if file is not None and installed_file(file):
                self.parts.append(f"class {_named(klass)} {_file_stamp(file)}")
                continue
            for name, value in list(vars(klass).items()):
                kind = type(value)
                if name.startswith("__") or as_function(value) is not None or issubclass(kind, _NOT_VALUES):
                    continue  # methods (the walk's), classes, modules, descriptors
                self.parts.append(f"class value {_named(klass)}.{name}")
                self.value(value, 1)

    def tensor(self, tensor: torch.Tensor, contents: bool) -> None:
        if tensor.is_nested:  # no sizes to read
            self.parts.append(f"nested tensor {tensor.dtype} {tensor.device.type} {tensor.dim()}")
            return
        device = tensor.device
        device = _DEVICE_TYPES.get(device) or _DEVICE_TYPES.setdefault(device, device.type)  # not its index
        self.parts.append(f"tensor {tensor.shape} {tensor.dtype} {device} {tensor.layout} {tensor.requires_grad}")
        kind = type(tensor)
        if kind is not torch.Tensor and kind is not nn.Parameter:  # a subclass (torchao's quantized weights)
            self.parts.append("subclass " + _named(kind))
            self.klass(kind, ("__torch_function__", "__torch_dispatch__"))
            self.plain_attributes(tensor, 1)
        if not contents or tensor.is_meta or tensor.is_nested or tensor.layout != torch.strided \
                or tensor.is_quantized or tensor.numel() == 0:
            return
        flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1)
        if flat.numel() > _SMALL:  # a large buffer: 65,536 values evenly spaced, the last among them
            step = -(-flat.numel() // _SMALL)
            flat = torch.cat((flat[::step], flat[-1:]))
            self.parts.append(f"sampled {step}")
        flat = flat.to("cpu")
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        flat = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.contiguous().view(torch.uint8)
        self.parts.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())

    def array(self, array) -> None:
        self.parts.append(f"array {getattr(array, 'shape', None)} {getattr(array, 'dtype', None)}")
        if getattr(array, "size", _SMALL + 1) <= _SMALL and getattr(array, "dtype", None) is not None \
                and array.dtype.kind != "O":
            self.parts.append(hashlib.sha256(array.tobytes()).hexdigest())
