"""A digest of Python values and of the code they reach: two calls whose digests agree describe the
same values and run the same code. The proof's cache (nn/whole_model/proof_cache.py) keys a proven
split by it, so that an edited model file, a patched function or flag, or a changed registry entry
is proven again.

Values (``Description.value``): simple ones by repr; tensors and arrays by shape, dtype and device,
small ones (up to 65,536 elements) by their contents too; containers item by item (named tuples,
dict subclasses); functions, methods, partials (with their arguments) and decorated functions
(``__wrapped__``, closures) are followed as code; other objects by class and attributes (their
``__dict__`` and ``__slots__``), and their class's methods followed. Objects of torch's and Python's
own classes count by class: their versions are in the cache's key.

Code (``_Walk``): from each function, its bytecode, constants, defaults and closure cells; every
global it loads, by value (a flag, a tuple, a helper, a class, a registry, a module, and of a module
the attributes the code names: ``nn.functional.silu``); and every name it uses that a class of the
method's owner defines, in each class of the MRO (``self.HEAD_MINOR``, ``self.helper``,
``super().forward``). Of a class the code meets it follows every method defined in the file of the
class itself (a module's own helpers, called through ``self.child.method``), and, of its other
bases, the methods it names. Functions in torch's and Python's own files count by name, except that
a global they load now holding code of another file (a patch: ``F.silu`` replaced), or a closure
they hold (a decorator's wrapped function), is followed too.
What it cannot see: code reached only through objects passed in at run time (a callback argument),
a library function's patched globals two calls deep, and code that is not Python.

A walk is remembered per set of start functions with every binding it read (each name's object, a
function's code, defaults and closure, and a snapshot of every mutable value), and reused while they
all still hold: a second call in one process checks those instead of walking again.
"""
import dis
import functools
import hashlib
import os
import site
import sys
import sysconfig
import types
from collections.abc import Mapping
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

_ABSENT = object()
_DEPTH = 6
_SMALL = 1 << 16
#: Registry entries described at most (transformers' largest holds a few dozen).
_REGISTRY_LIMIT = 256
_SIMPLE = frozenset({int, float, complex, str, bool, bytes, type(None), torch.dtype, torch.device, torch.Size,
                     type(Ellipsis), range, slice})
_BUILTIN = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
            types.MethodDescriptorType, types.MethodWrapperType)
#: Types as_function answers None for at once (most values the walk meets).
_PLAIN = _SIMPLE | {tuple, list, dict, set, frozenset, type, types.ModuleType, types.BuiltinFunctionType}
#: Module internals described by their own parts (parameters, buffers, children, hooks) or not part of
#: what the module computes; entries that name where a model came from, or only what generate reads (a
#: GenerationConfig also holds its own hash, which differs between processes).
_MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"})
PROVENANCE = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "generation_config",
                        "_original_object_hash"})
_MODULE_SKIPPED = _MODULE_INTERNALS | PROVENANCE
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
#: A class the code names: these methods are followed, besides those the code names.
_CONSTRUCTORS = ("__init__", "__post_init__", "__new__", "__call__", "forward")
_LOAD_GLOBAL, _EXTENDED_ARG = dis.opmap["LOAD_GLOBAL"], dis.opmap["EXTENDED_ARG"]
_GLOBAL_ARG_SHIFTED = sys.version_info >= (3, 11)  # LOAD_GLOBAL's argument holds the name's index shifted by 1
_GLOBAL_OPS = frozenset(dis.opmap[name] for name in ("LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"))


def _roots():
    """(torch's folder, Python's own library folders, the package folders that may lie inside them: conda
    and the python Docker images keep site-packages under the standard library's folder)."""
    sep = os.sep
    torch_dir = os.path.dirname(torch.__file__) + sep
    paths = sysconfig.get_paths()
    stdlib = tuple({paths[k] + sep for k in ("stdlib", "platstdlib") if paths.get(k)})
    sites = [paths.get("purelib"), paths.get("platlib")]
    try:
        sites += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site.py
        pass
    return torch_dir, stdlib, tuple({s + sep for s in sites if s})


_TORCH_DIR, _STDLIB, _SITES = _roots()
_named_only_files: Dict[str, bool] = {}


def named_only_file(filename: str) -> bool:
    """Whether a function of this file counts by name (torch's and the standard library's)."""
    answer = _named_only_files.get(filename)
    if answer is None:
        answer = filename.startswith((_TORCH_DIR, "<frozen ")) or (
            filename.startswith(_STDLIB) and not filename.startswith(_SITES)
            and "site-packages" not in filename and "dist-packages" not in filename)
        _named_only_files[filename] = answer
    return answer


def _named_only(function: types.FunctionType) -> bool:
    return named_only_file(function.__code__.co_filename)


_library_classes: Dict[type, bool] = {}


def _library_class(cls: type) -> bool:
    """A class of torch, Python or a C extension: counted by name. A class of a notebook or of a module
    without a file is not one."""
    answer = _library_classes.get(cls)
    if answer is None:
        module = getattr(cls, "__module__", None)
        module = module if isinstance(module, str) else ""
        file = getattr(sys.modules.get(module), "__file__", None)
        answer = (module == "builtins" or module.split(".")[0] == "torch"
                  or (isinstance(file, str) and (named_only_file(file) or not file.endswith(".py"))))
        _library_classes[cls] = answer
    return answer


def installed_file(filename: str) -> bool:
    return (named_only_file(filename) or filename.startswith(_SITES) or "site-packages" in filename
            or "dist-packages" in filename)


def _installed_class(cls: type) -> bool:
    """A class of an installed package (transformers, peft): its methods other than forward and __call__
    are followed where code names them, not all of them (a PeftModel's hundreds)."""
    file = getattr(sys.modules.get(getattr(cls, "__module__", None) or ""), "__file__", None)
    return isinstance(file, str) and installed_file(file)


_code_digests: Dict[types.CodeType, bytes] = {}
_global_names: Dict[types.CodeType, Tuple[str, ...]] = {}
_all_names: Dict[types.CodeType, Tuple[str, ...]] = {}


def _constant(value) -> str:
    """A constant's text, the same in every process (a frozenset's order follows string hashing)."""
    if isinstance(value, frozenset):
        return "frozenset(" + repr(sorted(_constant(v) for v in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ", ".join(_constant(v) for v in value) + ",)"
    if isinstance(value, types.CodeType):
        return code_digest(value).hex()
    if isinstance(value, int) and not isinstance(value, bool):
        return hex(value)  # repr refuses ints past 4,300 digits
    return repr(value)


def code_digest(code: types.CodeType) -> bytes:
    """The bytecode, names and constants of ``code`` (nested code by its own digest); line numbers are
    not part of it, so moving or commenting code keeps the digest."""
    digest = _code_digests.get(code)
    if digest is None:
        h = hashlib.sha256(code.co_code)
        h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount,
                       code.co_kwonlyargcount, code.co_posonlyargcount, code.co_flags)).encode())
        for const in code.co_consts:
            h.update(_constant(const).encode())
        digest = _code_digests[code] = h.digest()
    return digest


def _names(code: types.CodeType) -> Tuple[str, ...]:
    """Every name ``code`` and its nested code use (globals and attributes), sorted."""
    names = _all_names.get(code)
    if names is None:
        found = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found.update(_names(const))
            elif isinstance(const, str) and const.isidentifier():  # getattr(self, "HEAD_MINOR", False)
                found.add(const)
        names = _all_names[code] = tuple(sorted(found))
    return names


def _globals(code: types.CodeType) -> Tuple[str, ...]:
    """The names ``code`` and its nested code load (or store) as globals, sorted."""
    names = _global_names.get(code)
    if names is None:
        found = set()
        raw, table, extended = code.co_code, code.co_names, 0
        for offset in range(0, len(raw), 2):  # dis.get_instructions costs 20x this scan
            op, arg = raw[offset], raw[offset + 1] | extended
            if op == _EXTENDED_ARG:
                extended = arg << 8
                continue
            extended = 0
            if op == _LOAD_GLOBAL:
                found.add(table[arg >> 1 if _GLOBAL_ARG_SHIFTED else arg])
            elif op in _GLOBAL_OPS:
                found.add(table[arg])
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found.update(_globals(const))
        names = _global_names[code] = tuple(sorted(str(n) for n in found))
    return names


def as_function(value) -> Optional[types.FunctionType]:
    """The Python function behind a method, static or class method, property getter, cached property
    or partial."""
    kind = type(value)
    if kind is types.FunctionType:
        return value
    if kind in _PLAIN:
        return None
    # issubclass on type(value), not isinstance: a config's __getattribute__ would answer each __class__
    try:
        if issubclass(kind, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif issubclass(kind, property):
            value = value.fget
        elif issubclass(kind, functools.cached_property):
            value = value.func
        elif issubclass(kind, functools.partial):
            value = value.func
        else:
            return None
    except Exception:  # noqa: BLE001 - an attribute that raises
        return None
    return value if type(value) is types.FunctionType else None


def class_attribute(cls: type, name: str):
    """``name`` as an instance of ``cls`` finds it in its classes (torch's nn.Module and object left
    out: torch's version covers them)."""
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            continue
        value = klass.__dict__.get(name)
        if value is not None:
            return value
    return None


def _mro(cls: type) -> List[type]:
    return [k for k in cls.__mro__ if k is not nn.Module and k is not object]


def _named(value) -> str:
    return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', type(value).__qualname__)}"


def _file_of(cls: type) -> Optional[str]:
    for value in vars(cls).values():
        function = as_function(value)
        if function is not None:
            return function.__code__.co_filename
    return None


def own_methods(cls: type) -> List[types.FunctionType]:
    """Every method defined in ``cls``'s classes that live in its own file (a script's classes, a
    modeling file's): what its instances may call through any attribute."""
    file = _file_of(cls)
    found = []
    for klass in _mro(cls):
        if _library_class(klass) or (klass is not cls and _file_of(klass) != file):
            continue
        for name in sorted(vars(klass)):
            function = as_function(vars(klass)[name])
            if function is not None:
                found.append(function)
    return found


class Description:
    """Values as text parts (hashed by the caller), and the functions they lead to (``starts``)."""

    def __init__(self):
        self.parts: List[str] = []
        self.starts: List[Tuple[types.FunctionType, Optional[type]]] = []
        self.seen: Dict[int, tuple] = {}  # id -> (number, the value itself)
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
        if depth > _DEPTH:
            self.parts.append("deep " + kind.__qualname__)
            return
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
            for item in value:
                self.value(item, depth + 1)
        elif issubclass(kind, dict):
            self.parts.append(f"{_named(kind)}{{{len(value)}}}")
            for key, item in list(dict.items(value)):
                if type(key) is str and key in PROVENANCE:
                    continue
                self.value(key, depth + 1)
                self.value(item, depth + 1, names)
        elif issubclass(kind, (set, frozenset)):
            self.parts.append(f"{_named(kind)}" + repr(sorted(self.apart(item, depth + 1) for item in value)))
        elif issubclass(kind, Mapping):
            self.registry(value, depth)
        else:
            self.instance(value, kind, depth, names)

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
        self.klass(kind, names, own=not isinstance(self, _Walk))  # what a module holds: all its methods
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
        """An object's attributes that are simple values (by repr) or functions (followed); containers and
        other objects by class: what a library object holds that decides what code computes."""
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
            elif issubclass(kind, (tuple, list)) and all(type(v) in _SIMPLE for v in item):
                self.parts.append(f"{key} {item!r}")
            else:
                self.parts.append(f"{key}: {_named(kind)}")

    def klass(self, cls: type, names: Tuple[str, ...], own: bool = False) -> None:
        """A class the code meets: its constructors and __call__, and the methods ``names`` names, followed;
        with ``own``, every method of its own file too (an object a module holds: self.layout.split())."""
        if _library_class(cls):
            return
        if own and cls not in self.classes and not _installed_class(cls):
            self.classes.add(cls)
            for function in own_methods(cls):
                self.follow(function, cls)
        for name in _CONSTRUCTORS + names:
            definition = class_attribute(cls, name)
            found = as_function(definition)
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
        self.parts.append(f"module {name} {_named(cls)}")
        self.module_class(cls)
        attributes = vars(module)
        simple, other = [], []
        for key, value in attributes.items():
            if key in _MODULE_SKIPPED:
                continue
            (simple if type(value) in _SIMPLE else other).append(key)
        self.parts.append(repr(sorted((k, _constant(attributes[k]) if type(attributes[k]) is int
                                       else repr(attributes[k])) for k in simple)))
        for key in sorted(other):
            self.parts.append(key)
            self.value(attributes[key], depth + 1)
        for key in _HOOKS:
            self.hooks(attributes.get(key), depth)
        for pname, p in module._parameters.items():
            if p is not None:
                self.parts.append("parameter " + pname)
                self.tensor(p, contents=False)
                self.hooks(p._backward_hooks, depth)
                self.hooks(getattr(p, "_post_accumulate_grad_hooks", None), depth)
        for bname, b in module._buffers.items():
            if b is not None:
                self.parts.append(f"buffer {bname} {bname in module._non_persistent_buffers_set}")
                self.tensor(b, contents=True)
        if name is None:
            for child_name, child in module._modules.items():
                if child is not None:
                    self.parts.append("child " + child_name)
                    self.value(child, depth + 1)

    def hooks(self, hooks, depth: int) -> None:
        if hooks:
            for hook in list(hooks.values()):
                self.value(hook, depth + 1)

    def module_class(self, cls: type) -> None:
        if cls in self.classes:
            return
        self.classes.add(cls)
        for attribute in ("forward", "__call__"):
            function = as_function(class_attribute(cls, attribute))
            if function is not None:
                self.follow(function, cls)
        if not _library_class(cls) and not _installed_class(cls):  # a script's, a notebook's, a checkout's
            for function in own_methods(cls):
                self.follow(function, cls)

    def tensor(self, tensor: torch.Tensor, contents: bool) -> None:
        if tensor.is_nested:  # no sizes to read
            self.parts.append(f"nested tensor {tensor.dtype} {tensor.device.type} {tensor.dim()}")
            return
        self.parts.append(f"tensor {tuple(tensor.shape)} {tensor.dtype} {tensor.device.type} {tensor.layout} "
                          f"{tensor.requires_grad}")
        kind = type(tensor)
        if kind is not torch.Tensor and kind is not nn.Parameter:  # a subclass (torchao's quantized weights)
            self.parts.append("subclass " + _named(kind))
            self.klass(kind, ("__torch_function__", "__torch_dispatch__"))
            self.plain_attributes(tensor, 1)
        if not contents or tensor.is_meta or tensor.is_nested or tensor.layout != torch.strided \
                or tensor.is_quantized or tensor.numel() > _SMALL:
            return
        flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).to("cpu")
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        flat = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.contiguous().view(torch.uint8)
        self.parts.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())

    def array(self, array) -> None:
        self.parts.append(f"array {getattr(array, 'shape', None)} {getattr(array, 'dtype', None)}")
        if getattr(array, "size", _SMALL + 1) <= _SMALL and getattr(array, "dtype", None) is not None \
                and array.dtype.kind != "O":
            self.parts.append(hashlib.sha256(array.tobytes()).hexdigest())


def _snapshot(value, depth: int = 0):
    """What a mutable value holds now, compared within one process (identities, not descriptions): a
    dict or list changed in place, a tensor written in place, an object's attributes reassigned."""
    kind = type(value)
    if kind in _SIMPLE:
        return value
    if depth > 4:
        return id(value)
    try:
        if issubclass(kind, torch.Tensor):
            return ("tensor", id(value), value._version)
        if issubclass(kind, (list, tuple)):
            return (kind, tuple(_snapshot(v, depth + 1) for v in value))
        if issubclass(kind, dict):
            return (kind, tuple((_snapshot(k, depth + 1), _snapshot(v, depth + 1)) for k, v in list(dict.items(value))))
        if issubclass(kind, (set, frozenset)):
            return (kind, tuple(sorted(id(v) for v in value)))
        if issubclass(kind, Mapping):
            return (kind, tuple((repr(k), id(v)) for k, v in list(value.items())[:_REGISTRY_LIMIT]), len(value))
        if issubclass(kind, (type, types.ModuleType, types.FunctionType)):
            return id(value)
        if kind.__name__ == "ndarray":
            return ("array", id(value), value.shape, hashlib.sha256(value.tobytes()).digest()
                    if value.size <= _SMALL and value.dtype.kind != "O" else None)
        try:
            attributes = object.__getattribute__(value, "__dict__")
        except AttributeError:
            attributes = {}
        slots = tuple(getattr(value, slot, None) for klass in kind.__mro__
                      for slot in ((vars(klass).get("__slots__", ()),) if isinstance(vars(klass).get("__slots__", ()), str)
                                   else vars(klass).get("__slots__", ())) if slot not in ("__dict__", "__weakref__"))
        if _library_class(kind):  # what plain_attributes reads: its simple values and functions
            return ("library", id(value), tuple((k, v if type(v) in _SIMPLE else id(v))
                                                for k, v in list(dict.items(attributes))), tuple(map(id, slots)))
        return ("object", id(value), _snapshot(attributes, depth + 1), tuple(_snapshot(v, depth + 1) for v in slots))
    except Exception:  # noqa: BLE001 - not comparable: never the same, so the walk is run again
        return object()


class _Walk(Description):
    """One walk over the code reachable from its starts: the digest, and the bindings it read."""

    def __init__(self):
        super().__init__()
        self.checks: List[tuple] = []
        self.visited = set()
        self.stack: List[Tuple[types.FunctionType, Optional[type]]] = []
        self.owner_definitions: Dict[type, Dict[str, list]] = {}
        self.class_checked = set()
        self.model_files = set()  # the files of the start functions' classes

    def follow(self, function, owner) -> None:
        self.stack.append((function, owner))

    def checked(self, value) -> None:
        if type(value) not in _SIMPLE:
            self.checks.append(("value", value, _snapshot(value)))

    def bound(self, cls: type, name: str, definition) -> None:
        self.checks.append(("class", cls, name, definition))

    def run(self, starts: Iterable[Tuple[types.FunctionType, Optional[type]]]) -> bytes:
        self.stack.extend(reversed(list(starts)))
        while self.stack:
            function, owner = self.stack.pop()
            if (function, owner) in self.visited:
                continue
            self.visited.add((function, owner))
            self.function(function, owner)
        return hashlib.sha256("\0".join(self.parts).encode()).digest()

    def deep(self, function: types.FunctionType) -> bool:
        """Whether a function is followed through its globals and class: the model's own files' (its
        modules' classes') and code outside installed packages (a script's, a notebook's)."""
        file = function.__code__.co_filename
        return file in self.model_files or not installed_file(file)

    def function(self, function: types.FunctionType, owner: Optional[type]) -> None:
        self.parts.append("def " + _named(function))
        self.checks.append(("code", function, (function.__code__, function.__defaults__, function.__kwdefaults__)))
        wrapped = function.__dict__.get("__wrapped__")
        if wrapped is not None:  # a decorated method: the function it wraps is a method of the same class
            self.checks.append(("get", function.__dict__, "__wrapped__", wrapped))
            inner = as_function(wrapped)
            if inner is not None:
                self.parts.append("wraps " + _named(inner))
                self.follow(inner, owner)
            else:
                self.value(wrapped, 1)
        if not self.deep(function):  # a library's: its own code, and which function each global names
            file = function.__code__.co_filename
            if not _named_only(function):
                self.parts.append(code_digest(function.__code__).hex())
                self.parts.append(_file_stamp(file))  # its package's other code: by its files' stamps
            self.cells(function, owner, shallow=True)
            self.library_globals(function)
            return
        code = function.__code__
        self.parts.append(code_digest(code).hex())
        self.value(function.__defaults__, 1)
        self.value(function.__kwdefaults__, 1)
        self.cells(function, owner)
        names = _names(code)
        if owner is not None:
            self.class_names(owner, names)
        space = function.__globals__
        for name in _globals(code):
            found = space.get(name, _ABSENT)
            self.checks.append(("get", space, name, found))
            if found is not _ABSENT:
                self.parts.append("global " + name)
                self.value(found, 1, names)

    def cells(self, function: types.FunctionType, owner: Optional[type], shallow: bool = False) -> None:
        """The closure's values. A function there (what a decorator wraps) is followed as a method of the
        same class; a library decorator's other values count when simple, a registry, or an object by its
        simple attributes (autocast's dtype)."""
        for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # not yet bound
                contents = _ABSENT
            if contents is _ABSENT or name == "__class__":  # super()'s class: the owner's MRO is read
                continue
            self.checks.append(("cell", cell, None, contents))
            inner = as_function(contents)
            if inner is not None and type(contents) is types.FunctionType:
                self.parts.append("closes over " + _named(inner))
                self.follow(inner, owner)
            elif not shallow or type(contents) in _SIMPLE or inner is not None \
                    or issubclass(type(contents), (type, types.ModuleType) + _BUILTIN):
                self.value(contents, 1)
            elif issubclass(type(contents), Mapping):
                self.checked(contents)
                self.registry(contents, 1)
            else:
                self.checked(contents)
                self.parts.append("object " + _named(type(contents)))
                self.plain_attributes(contents, 1)

    def class_names(self, owner: type, names: Tuple[str, ...]) -> None:
        """Names the code uses that a class of ``owner``'s MRO defines: each definition (super() reaches past
        the first), and its absence from the other classes (a definition added later shadows)."""
        defined = self.definitions(owner)
        for name in names:
            found = defined.get(name)
            if found is None:
                continue
            for klass, value in found:
                key = (id(klass), name)
                if key not in self.class_checked:
                    self.class_checked.add(key)
                    self.checks.append(("get", vars(klass), name, value))
                if value is _ABSENT:
                    continue
                self.parts.append(f"attribute {name} of {_named(klass)}")
                function = as_function(value)
                if function is not None:
                    self.parts.append("function " + _named(function))
                    self.follow(function, owner)
                    if isinstance(value, functools.partial):
                        self.value((value.args, value.keywords), 1)
                else:
                    self.value(value, 1)

    def definitions(self, owner: type) -> "_Definitions":
        """{name: [(class, its value or _ABSENT) for every class of owner's MRO], or None where no class
        defines it}, filled as names are asked for (once per walk and owner)."""
        found = self.owner_definitions.get(owner)
        if found is None:
            found = self.owner_definitions[owner] = _Definitions(_mro(owner))
        return found

    def library_globals(self, function: types.FunctionType) -> None:
        """A library function's globals, one level: which function each name holds (a patch of another
        file's code is followed)."""
        names = _names(function.__code__)
        space = function.__globals__
        for name in _globals(function.__code__):
            found = space.get(name, _ABSENT)
            self.checks.append(("get", space, name, found))
            if isinstance(found, types.ModuleType):
                self.library_module(found, names)
            elif found is not _ABSENT and not isinstance(found, type):
                self.library_value(name, found)

    def library_module(self, module: types.ModuleType, names: Tuple[str, ...], depth: int = 0) -> None:
        space = module.__dict__
        for name in names:
            found = space.get(name, _ABSENT)
            if found is _ABSENT or isinstance(found, type):
                continue
            self.checks.append(("get", space, name, found))
            if isinstance(found, types.ModuleType):
                if depth < 2:  # nn.functional.silu
                    self.library_module(found, names, depth + 1)
            else:
                self.library_value(name, found)

    def library_value(self, name: str, found) -> None:
        function = as_function(found)
        kind = type(found)
        if function is not None:
            self.parts.append(f"{name} = {_named(function)}")
            if self.deep(function):  # a patch of the model's or the user's code
                self.follow(function, None)
        elif issubclass(kind, _BUILTIN):
            self.parts.append(f"{name} = {_named(found)}")
        elif issubclass(kind, Mapping) and not issubclass(kind, dict) and not _library_class(kind):
            self.parts.append(f"{name} =")  # a registry of another package (transformers' mask functions)
            self.checked(found)
            self.registry(found, 1)

    def module_attributes(self, module: types.ModuleType, names: Tuple[str, ...], depth: int) -> None:
        space = module.__dict__
        file = getattr(module, "__file__", None)
        if module.__name__ in sys.builtin_module_names or (isinstance(file, str) and named_only_file(file)):
            # sys, os, torch: which function each name holds
            self.library_module(module, names)
            return
        for name in names:
            found = space.get(name, _ABSENT)
            if found is _ABSENT:
                continue
            self.checks.append(("get", space, name, found))
            if isinstance(found, types.ModuleType):
                if depth < 2:
                    self.module_attributes(found, names, depth + 1)
                continue
            self.parts.append(f"{module.__name__}.{name}")
            if type(found) in _SIMPLE or isinstance(found, (type, tuple, list, dict, set, frozenset, torch.Tensor,
                                                            functools.partial) + _BUILTIN) \
                    or as_function(found) is not None:
                self.value(found, 2, names)
            else:  # an object another module holds: its class, and its __call__
                self.parts.append("object " + _named(type(found)))
                self.klass(type(found), ("__call__",))


class _Definitions(dict):
    def __init__(self, classes: List[type]):
        super().__init__()
        self.classes = classes

    def __missing__(self, name: str):
        found = [(klass, vars(klass).get(name, _ABSENT)) for klass in self.classes]
        self[name] = found if any(value is not _ABSENT for _, value in found) else None
        return self[name]

    def get(self, name, default=None):
        return self[name]


_stamps: Dict[str, str] = {}


def _file_stamp(file: str) -> str:
    """An installed file's size and modification time, once per process: a package upgraded or edited in
    place changes it, and with it the constants and helpers its functions reach (not walked)."""
    stamp = _stamps.get(file)
    if stamp is None:
        try:
            stat = os.stat(file)
            stamp = f"{stat.st_size} {stat.st_mtime_ns}"
        except OSError:
            stamp = "?"
        _stamps[file] = stamp
    return stamp


class _Checks:
    """A walk's bindings by kind, each kind checked in one pass."""

    def __init__(self, checks: List[tuple]):
        self.gets = [(c[1], c[2], c[3]) for c in checks if c[0] == "get"]
        self.classes = [(c[1], c[2], c[3]) for c in checks if c[0] == "class"]
        self.code = [(c[1], c[2]) for c in checks if c[0] == "code"]
        self.cells = [(c[1], c[3]) for c in checks if c[0] == "cell"]
        self.values = [(c[1], c[2]) for c in checks if c[0] == "value"]

    def hold(self) -> bool:
        return (all(space.get(name, _ABSENT) is found for space, name, found in self.gets)
                and all(class_attribute(cls, name) is found for cls, name, found in self.classes)
                and all((f.__code__, f.__defaults__, f.__kwdefaults__) == found for f, found in self.code)
                and all(_cell(cell) is found for cell, found in self.cells)
                and all(_snapshot(value) == snapshot for value, snapshot in self.values))


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _ABSENT


_walks: Dict[frozenset, Tuple[bytes, _Checks]] = {}


def reachable_code_digest(starts: Iterable[Tuple[types.FunctionType, Optional[type]]]) -> bytes:
    """The digest of the code reachable from ``starts`` ((function, the class it is a method of, or
    None)), reusing this process's last walk from the same starts while every binding it read holds."""
    starts = frozenset(starts)
    remembered = _walks.get(starts)
    if remembered is not None and remembered[1].hold():
        return remembered[0]
    walk = _Walk()
    for _, owner in starts:
        file = getattr(sys.modules.get(getattr(owner, "__module__", None) or ""), "__file__", None)
        if isinstance(file, str) and not named_only_file(file):
            walk.model_files.add(file)
    digest = walk.run(sorted(starts, key=lambda s: (_named(s[0]), _named(s[1]) if s[1] else "")))
    _walks[starts] = (digest, _Checks(walk.checks))
    return digest
