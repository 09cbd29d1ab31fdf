"""The walk over the code a model runs (``reachable_code_digest``), and its reuse within a process while
every binding it read still holds."""
import functools
import hashlib
import itertools
import operator
import os
import sys
import types
from collections.abc import Mapping
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .bytecode import _ABSENT, _BUILTIN, _REGISTRY_LIMIT, _SIMPLE, _SMALL, _globals, _mro, _named, _names, as_function, class_attribute, code_digest
from .files import _file_stamp, _library_class, _named_only, installed_file, named_only_file
from .values import Description


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


def _unchanging(value, depth: int = 0) -> bool:
    """Whether ``value``'s snapshot can never change: a simple value, or a tuple or frozenset of simple
    values, functions, classes and modules (which snapshot by identity, and a tuple holds them)."""
    kind = type(value)
    if kind in _SIMPLE:
        return True
    if depth > 0 and (kind is types.FunctionType or kind is type or kind is types.ModuleType):
        return True
    if (kind is tuple or kind is frozenset) and depth <= 3:
        return all(_unchanging(item, depth + 1) for item in value)
    return False


class _Walk(Description):
    """One walk over the code reachable from its starts: the digest, and the bindings it read."""

    follows_held_classes = False

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
        if not _unchanging(value):
            self.checks.append(("value", value, _snapshot(value)))

    def bound(self, cls: type, name: str, definition) -> None:
        self.checks.append(("class", cls, name, definition))

    def environment_read(self, name: str, found) -> None:
        self.checks.append(("environ", name, found))

    def class_values(self, cls: type) -> None:
        """Not part of the walk (reused while its bindings hold): the model's description reads them each
        time."""

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
            if found is os.environ:  # os.environ.get("FLAG")
                self.environment(names)
                continue
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


class _Checks:
    """A walk's bindings by kind, each kind checked in one pass."""

    def __init__(self, checks: List[tuple]):
        gets, seen = [], set()
        for c in checks:
            if c[0] == "get" and (id(c[1]), c[2], id(c[3])) not in seen:  # each binding once
                seen.add((id(c[1]), c[2], id(c[3])))
                gets.append((c[1], c[2], c[3]))
        # A plain dict's bindings (a module's globals) are looked up by dict.get in C, in one map.
        plain = [g for g in gets if type(g[0]) is dict]
        self.dict_spaces = [g[0] for g in plain]
        self.dict_names = [g[1] for g in plain]
        self.dict_found = [g[2] for g in plain]
        self.gets = [g for g in gets if type(g[0]) is not dict]
        self.classes = [(c[1], c[2], c[3]) for c in checks if c[0] == "class"]
        self.code = [(c[1], c[2]) for c in checks if c[0] == "code"]
        self.cells = [(c[1], c[3]) for c in checks if c[0] == "cell"]
        self.values = [(c[1], c[2]) for c in checks if c[0] == "value"]
        self.environment = [(c[1], c[2]) for c in checks if c[0] == "environ"]

    def hold(self) -> bool:
        return (all(map(operator.is_, map(dict.get, self.dict_spaces, self.dict_names, itertools.repeat(_ABSENT)),
                        self.dict_found))
                and all(space.get(name, _ABSENT) is found for space, name, found in self.gets)
                and all(class_attribute(cls, name) is found for cls, name, found in self.classes)
                and all((f.__code__, f.__defaults__, f.__kwdefaults__) == found for f, found in self.code)
                and all(_cell(cell) is found for cell, found in self.cells)
                and all(_snapshot(value) == snapshot for value, snapshot in self.values)
                and all(os.environ.get(name) == found for name, found in self.environment))


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
