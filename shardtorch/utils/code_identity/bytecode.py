"""Code objects and functions as the proof's key reads them: a code object's digest (bytecode, names,
constants; not line numbers), the names it uses and the globals it loads, the function behind a
method, property or partial, a name as a class's instances find it, and the values that count as
simple."""
import dis
import functools
import hashlib
import sys
import types
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .files import _library_class


_ABSENT = object()
_DEPTH = 12
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


_methods: Dict[Tuple[type, str], tuple] = {}


def method_of(cls: type, name: str) -> tuple:
    """``class_attribute(cls, name)`` and the function behind it (or None), kept per class and name while
    what ``cls``'s instances find under ``name`` is the same object (a patch anywhere in the MRO changes it;
    a getattr answering a fresh object each time, a class method's, is looked up each time)."""
    try:
        seen = getattr(cls, name, None)
    except Exception:  # noqa: BLE001 - a class whose lookups raise (a missing backend's placeholder)
        definition = class_attribute(cls, name)
        return definition, as_function(definition)
    kept = _methods.get((cls, name))
    if kept is not None and kept[0] is seen:
        return kept[1], kept[2]
    definition = class_attribute(cls, name)
    found = as_function(definition)
    _methods[(cls, name)] = (seen, definition, found)
    return definition, found


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
