"""A digest of the Python code that functions can reach by name: two calls whose digests agree run
the same code. The proof's cache (nn/whole_model/proof_cache.py) keys a proven split by it, so that
an edited model file, a patched function or a changed registry is proven again.

From each start function (a module class's forward, a hook, a function an instance holds) it
follows, as the running code would look names up:
- the function's bytecode, constants (nested functions too), defaults and closure cells;
- each name its code uses: in the class it was reached from (``self.method``, properties, static and
  class methods), and in its globals: a function, a simple value (a flag), a class (its constructor,
  forward and the methods the code names), a module (the attributes the code names: ``F.softmax``),
  a registry (a Mapping's functions: transformers' attention functions by name).
Functions in torch's and Python's own files are named, not followed (their versions are in the cache's
key), except where a name they use now holds a function of other code (a patch): one level deep.
What it cannot see: functions reached only through objects passed in at run time (a callback
argument, a cache object's methods) and code that is not Python (torch's version covers torch's).

A walk is remembered per set of start functions with every binding it read (a name's object, a
function's code and defaults, a registry's functions), and reused while they all still hold: a
second call in one process checks bindings instead of walking again.
"""
import functools
import hashlib
import os
import sysconfig
import types
from collections.abc import Mapping
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

#: Files whose functions are named, not followed: torch's and Python's own (their versions are in the key).
_NAMED_ONLY = (os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
_SIMPLE = (int, float, str, bool, bytes, type(None))
_BUILTIN = (types.BuiltinFunctionType, types.BuiltinMethodType)
#: A class named by the code: these methods are followed, besides those the code names.
_CONSTRUCTORS = ("__init__", "__post_init__", "__new__", "__call__", "forward")
#: Registry entries followed at most (transformers' largest holds a few dozen).
_REGISTRY_LIMIT = 256

_code_digests: Dict[types.CodeType, bytes] = {}
_code_names: Dict[types.CodeType, Tuple[str, ...]] = {}


def code_digest(code: types.CodeType) -> bytes:
    """The bytecode, names and constants of ``code`` (nested code by its own digest); line numbers are
    not part of it, so moving or commenting code keeps the digest."""
    digest = _code_digests.get(code)
    if digest is None:
        h = hashlib.sha256(code.co_code)
        h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
                       code.co_kwonlyargcount, code.co_flags)).encode())
        for const in code.co_consts:
            h.update(code_digest(const) if isinstance(const, types.CodeType) else _constant(const).encode())
        digest = _code_digests[code] = h.digest()
    return digest


def _constant(value) -> str:
    """A constant's text, the same in every process (a frozenset's order follows string hashing, which
    differs between processes)."""
    if isinstance(value, frozenset):
        return "frozenset(" + repr(sorted(_constant(v) for v in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ", ".join(_constant(v) for v in value) + ",)"
    return repr(value)


def _names(code: types.CodeType) -> Tuple[str, ...]:
    """Every name ``code`` and its nested code use, sorted (the walk's order is the digest's)."""
    names = _code_names.get(code)
    if names is None:
        found = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found.update(_names(const))
        names = _code_names[code] = tuple(sorted(found))
    return names


def as_function(value) -> Optional[types.FunctionType]:
    """The Python function behind a method, static or class method, property getter or partial."""
    kind = type(value)
    if kind is types.FunctionType:
        return value
    if kind in _SIMPLE_TYPES:  # most values the walk meets: no isinstance chain for them
        return None
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    elif isinstance(value, functools.partial):
        value = value.func
    return value if isinstance(value, types.FunctionType) else None


_SIMPLE_TYPES = frozenset({int, float, str, bool, bytes, type(None), tuple, list, dict, type, types.ModuleType,
                           types.BuiltinFunctionType})


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


def _named_only(function: types.FunctionType) -> bool:
    return function.__code__.co_filename.startswith(_NAMED_ONLY)


def _named(value) -> str:
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


class _Walk:
    """One walk: the digest, and the bindings it read (to check before reusing it)."""

    def __init__(self):
        self.hash = hashlib.sha256()
        self.bindings: Dict[tuple, tuple] = {}  # (kind, id(where), name) -> (kind, where, name, what it found)
        self.seen = set()
        self.stack: List[Tuple[types.FunctionType, Optional[type]]] = []
        self.namespaces: Dict[type, dict] = {}

    def run(self, starts: Iterable[Tuple[types.FunctionType, Optional[type]]]) -> bytes:
        self.stack.extend(starts)
        while self.stack:
            function, owner = self.stack.pop()
            if (function, owner) in self.seen:
                continue
            self.seen.add((function, owner))
            self._function(function, owner)
        return self.hash.digest()

    def _function(self, function: types.FunctionType, owner: Optional[type]) -> None:
        self.hash.update(_named(function).encode())
        if _named_only(function):
            self._patched_names(function)
            return
        code = function.__code__
        self._bind("code", function, None, (code, function.__defaults__, function.__kwdefaults__))
        self.hash.update(code_digest(code))
        self._value(function.__defaults__)
        self._value(function.__kwdefaults__)
        for cell in function.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # not yet bound
                continue
            self._bind("cell", cell, None, contents)
            self._value(contents)
        names = _names(code)
        space = function.__globals__
        in_class = self._namespace(owner) if owner is not None else {}
        for name in names:
            found = in_class.get(name)
            if found is not None:
                self._bind("class", owner, name, found)
                inner = as_function(found)
                if inner is not None:
                    self.stack.append((inner, owner))
            value = space.get(name)
            if value is None:
                continue
            self._bind("global", space, name, value)
            self.hash.update(name.encode())
            self._global(value, names)

    def _namespace(self, cls: type) -> dict:
        """What class_attribute finds in ``cls``, as one dict (built once per walk: a model's class has a
        dozen bases and its methods use a hundred names)."""
        found = self.namespaces.get(cls)
        if found is None:
            found = {}
            for klass in reversed(cls.__mro__):
                if klass is not nn.Module and klass is not object:
                    found.update((k, v) for k, v in klass.__dict__.items() if v is not None)
            self.namespaces[cls] = found
        return found

    def _patched_names(self, function: types.FunctionType) -> None:
        """A library function's names, one level: a function of other code found under one of them (a
        patch: F.silu replaced, under nn.SiLU's forward) is followed; library functions stay named."""
        names = _names(function.__code__)
        space = function.__globals__
        for name in names:
            value = space.get(name)
            if isinstance(value, types.ModuleType):
                inner = value.__dict__
                for attribute in names:
                    self._library_binding(inner, attribute)
            elif value is not None:
                self._library_binding(space, name)

    def _library_binding(self, space: dict, name: str) -> None:
        found = as_function(space.get(name))
        if found is None:
            return
        self._bind("global", space, name, space.get(name))
        if not _named_only(found):
            self.hash.update(name.encode())
            self.stack.append((found, None))

    def _global(self, value, names: Tuple[str, ...]) -> None:
        function = as_function(value)
        if function is not None:
            self.stack.append((function, None))
        elif isinstance(value, _SIMPLE):
            self.hash.update(repr(value).encode())
        elif isinstance(value, _BUILTIN):
            self.hash.update(_named(value).encode())
        elif isinstance(value, type):
            self.hash.update(_named(value).encode())
            if not value.__module__.startswith(("torch", "builtins", "typing")):
                for name in _CONSTRUCTORS + names:
                    found = as_function(class_attribute(value, name))
                    if found is not None:
                        self._bind("class", value, name, class_attribute(value, name))
                        self.stack.append((found, value))
        elif isinstance(value, types.ModuleType):
            self._module_attributes(value, names, 0)
        elif isinstance(value, Mapping):
            self._registry(value)

    def _module_attributes(self, module: types.ModuleType, names: Tuple[str, ...], depth: int) -> None:
        """The functions of ``module`` under names the code uses, and of its submodules so named
        (``nn.functional.silu``), never by getattr: a lazy module would import on it."""
        space = module.__dict__
        for name in names:
            found = space.get(name)
            if found is None:
                continue
            if as_function(found) is not None or isinstance(found, _BUILTIN):
                self._bind("global", space, name, found)
                self.hash.update(name.encode())
                self._global(found, ())
            elif isinstance(found, types.ModuleType) and depth < 2:
                self._bind("global", space, name, found)
                self._module_attributes(found, names, depth + 1)

    def _registry(self, mapping: Mapping) -> None:
        try:
            entries = [(k, v) for k, v in list(mapping.items())[:_REGISTRY_LIMIT]]
        except Exception:  # noqa: BLE001 - a mapping that cannot list itself: named only
            return
        functions = tuple((k, v) for k, v in entries if as_function(v) is not None)
        self._bind("registry", mapping, None, (len(mapping), functions))
        for key, value in functions:
            self.hash.update(repr(key).encode())
            self.stack.append((as_function(value), None))

    def _bind(self, kind: str, where, name: Optional[str], found) -> None:
        self.bindings[(kind, id(where), name)] = (kind, where, name, found)

    def _value(self, value) -> None:
        """A default argument or closure cell: simple values by repr, functions followed."""
        function = as_function(value)
        if function is not None:
            self.stack.append((function, None))
        elif isinstance(value, _SIMPLE):
            self.hash.update(repr(value).encode())
        elif isinstance(value, (tuple, list)):
            for item in value:
                self._value(item)
        elif isinstance(value, dict):
            for key, item in value.items():
                self.hash.update(repr(key).encode())
                self._value(item)
        else:
            self.hash.update(type(value).__qualname__.encode())


def _registry_holds(mapping, found) -> bool:
    size, functions = found  # the same size, and the same function under each key
    try:
        return len(mapping) == size and all(mapping.get(k) is v for k, v in functions)
    except Exception:  # noqa: BLE001
        return False


def _cell_holds(cell, found) -> bool:
    try:
        return cell.cell_contents is found
    except ValueError:
        return False


class _Bindings:
    """A walk's bindings by kind, each kind checked in one pass."""

    def __init__(self, bindings: Iterable[tuple]):
        self.globals, self.classes, self.code, self.other = [], [], [], []
        for kind, where, name, found in bindings:
            if kind == "global":
                self.globals.append((where, name, found))
            elif kind == "class":
                self.classes.append((where, name, found))
            elif kind == "code":
                self.code.append((where, found))
            else:
                self.other.append((kind, where, found))

    def hold(self) -> bool:
        return (all(space.get(name) is found for space, name, found in self.globals)
                and all((f.__code__, f.__defaults__, f.__kwdefaults__) == found for f, found in self.code)
                and all(class_attribute(cls, name) is found for cls, name, found in self.classes)
                and all(_cell_holds(where, found) if kind == "cell" else _registry_holds(where, found)
                        for kind, where, found in self.other))


_walks: Dict[frozenset, Tuple[bytes, _Bindings]] = {}


def reachable_code_digest(starts: Iterable[Tuple[types.FunctionType, Optional[type]]]) -> bytes:
    """The digest of the code reachable from ``starts`` ((function, the class it is a method of, or
    None)), reusing this process's last walk from the same starts while every binding it read holds."""
    starts = frozenset(starts)
    remembered = _walks.get(starts)
    if remembered is not None and remembered[1].hold():
        return remembered[0]
    walk = _Walk()
    digest = walk.run(sorted(starts, key=lambda s: (_named(s[0]), _named(s[1]) if s[1] else "")))
    _walks[starts] = (digest, _Bindings(walk.bindings.values()))
    return digest
