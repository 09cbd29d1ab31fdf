"""The package's modules import each other without cycles, and distributed/ does not import from
nn/ (the layer above it).

The graph is read from the sources (ast), not by importing: every ``import`` and ``from ... import``
of a shardtorch module, at the top of a file or inside a function alike (an import inside a function
to dodge a cycle is still the cycle). ``from package import name`` counts as an import of the module
that defines ``name`` (a submodule, or the module the package's __init__.py takes it from), so that
the package files, which import their whole package, do not join every module into one cycle."""
import ast
import os
from typing import Dict, List, Optional, Set

from tests.launcher import REPO

PACKAGE = os.path.join(REPO, "shardtorch")

# Cycles left, each with why it stays: {frozenset of modules: reason}.
ALLOWED_CYCLES = {}


def _modules() -> Dict[str, str]:
    """{dotted name: path} of every module of the package (a package by its __init__.py)."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(open(path).read(), path) for name, path in MODULES.items()}
PACKAGES = {name for name, path in MODULES.items() if path.endswith("__init__.py")}


def _absolute(importer: str, level: int, name: Optional[str]) -> str:
    if not level:
        return name or ""
    base = importer.split(".") if importer in PACKAGES else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _defining_module(module: str, name: Optional[str], depth: int = 0) -> Optional[str]:
    """The non-package module that ``from module import name`` (``import module`` when name is None)
    reaches, following a package's __init__.py to where it takes ``name`` from; None for a package
    itself or a name defined in a package's __init__.py."""
    target = f"{module}.{name}" if name else module
    if target in MODULES:
        return None if target in PACKAGES else target
    if module in PACKAGES and name and depth < 8:
        for node in TREES[module].body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return _defining_module(_absolute(module, node.level, node.module), alias.name, depth + 1)
        return None
    return module if module in MODULES and module not in PACKAGES else None  # a name the module defines


def import_graph() -> Dict[str, Dict[str, int]]:
    """{module: {module it imports: line}} over the package's non-package modules."""
    graph = {}
    for importer in set(MODULES) - PACKAGES:
        edges = {}
        for node in ast.walk(TREES[importer]):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_defining_module(alias.name, None) for alias in node.names
                           if alias.name.split(".")[0] == "shardtorch"]
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(importer, node.level, node.module)
                if module.split(".")[0] == "shardtorch":
                    targets = [_defining_module(module, alias.name) for alias in node.names]
            for target in targets:
                if target is not None and target != importer:
                    edges.setdefault(target, node.lineno)
        graph[importer] = edges
    return graph


def cycles(graph: Dict[str, Dict[str, int]]) -> List[Set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.add(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_inside_functions_and_through_package_files():
    graph = import_graph()
    # Inside a function (init_replay.targets_of imports shard_facts there).
    assert "shardtorch.utils.shard_facts" in graph["shardtorch.pretrained.init_replay"]
    # Through a package's __init__.py: ``from ..utils import shard_facts``-style imports name a module,
    # ``from ..nn import init`` a submodule of nn.
    assert "shardtorch.nn.init" in graph["shardtorch.pretrained.chunked_draw"]
    assert "shardtorch.utils.shard_specs" in graph["shardtorch.checkpoint.layout"]


def test_no_import_cycles_but_the_allowed_ones():
    graph = import_graph()
    found = cycles(graph)
    unexpected = [sorted(component) for component in found if frozenset(component) not in ALLOWED_CYCLES]
    described = "\n".join(
        " <-> ".join(component) + "\n    " + "; ".join(f"{a} imports {b} (line {graph[a][b]})" for a in component
                                                    for b in component if b in graph[a])
        for component in unexpected)
    assert not unexpected, f"import cycles:\n{described}"
    # An allowed cycle that is gone: drop it from the list.
    assert set(ALLOWED_CYCLES) <= {frozenset(component) for component in found}, ALLOWED_CYCLES


def test_distributed_does_not_import_from_nn():
    graph = import_graph()
    upward = {(a, b, line) for a, edges in graph.items() if a.startswith("shardtorch.distributed.")
              for b, line in edges.items() if b.startswith("shardtorch.nn.")}
    assert not upward, sorted(upward)
