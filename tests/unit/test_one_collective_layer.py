"""Every collective of the Python package goes through shardtorch/distributed/collectives.py: no
other module of shardtorch/ calls a torch.distributed collective (dist.all_reduce, a ProcessGroup's
allreduce, torch's functional collectives), so that SHARDTORCH_DEBUG, the shared-memory path and
the NCCL fault rules of csrc/comm cover all of its traffic.

Read from the sources (ast), not by importing: calls through any name bound to torch.distributed
(``import torch.distributed as dist``, ``from torch import distributed``), through the full
``torch.distributed.x`` chain, names imported from torch.distributed's modules, and ProcessGroup
methods."""
import ast
import os

from tests.launcher import REPO

PACKAGE = os.path.join(REPO, "shardtorch")
LAYER = os.path.join(PACKAGE, "distributed", "collectives.py")

# torch.distributed's collectives and point-to-point calls.
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
    "batch_isend_irecv",
}
# A c10d ProcessGroup's own methods (names torch's other objects do not use).
PROCESS_GROUP_METHODS = {
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "_allgather_base", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
}
# Modules whose every call is a collective.
COLLECTIVE_MODULES = {"torch.distributed._functional_collectives", "torch.distributed._symmetric_memory"}


def _dotted(node: ast.AST) -> str:
    """'torch.distributed.all_reduce' for that attribute chain; '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id] + parts[::-1])


def direct_collectives(source: str, filename: str = "<source>"):
    """[(line, what)] of the torch.distributed collectives ``source`` calls or imports."""
    tree = ast.parse(source, filename)
    aliases = {}  # local name -> the torch.distributed module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in COLLECTIVE_MODULES:
                    found.append((node.lineno, f"import {alias.name}"))
                if alias.name.startswith("torch.distributed") and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if node.module.startswith("torch.distributed") and alias.name in COLLECTIVES:
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                elif full in COLLECTIVE_MODULES or node.module in COLLECTIVE_MODULES:
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                elif full.startswith("torch.distributed"):
                    aliases[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        method = node.func.attr
        if method in PROCESS_GROUP_METHODS:
            found.append((node.lineno, f".{method}(...)"))
            continue
        owner = _dotted(node.func.value)
        head, _, rest = owner.partition(".")
        module = aliases[head] + ("." + rest if rest else "") if head in aliases else owner
        if method in COLLECTIVES and (module == "torch.distributed" or module.startswith("torch.distributed.")):
            found.append((node.lineno, f"{owner}.{method}(...)"))
    return sorted(found)


def test_no_module_but_the_layer_calls_torch_distributed_collectives():
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            path = os.path.join(folder, file)
            if not file.endswith(".py") or path == LAYER:
                continue
            for line, what in direct_collectives(open(path).read(), path):
                offenders.append(f"{os.path.relpath(path, REPO)}:{line}: {what}")
    assert not offenders, ("call shardtorch.distributed.collectives instead of torch.distributed "
                           "(docstring of shardtorch/distributed/collectives.py):\n" + "\n".join(offenders))


def test_the_layer_itself_is_seen_calling_them():
    # The checker finds what it must: the layer's own fallbacks to torch.distributed.
    found = {what for _, what in direct_collectives(open(LAYER).read(), LAYER)}
    assert {"dist.all_reduce(...)", "dist.all_gather_object(...)", "dist.send(...)"} <= found, found


def test_every_spelling_is_caught():
    source = """
import torch
import torch.distributed as dist
import torch.distributed as c10d_alias
from torch import distributed
from torch.distributed import all_gather, distributed_c10d
from torch.distributed import _functional_collectives as funcol
import torch.distributed._functional_collectives
torch.distributed.broadcast(t, 0)
dist.barrier()
c10d_alias.send(t, 1)
distributed.recv(t, 0)
distributed_c10d.all_reduce(t)
group.allreduce([t])
dist.get_rank()
torch.broadcast_tensors(a, b)
"""
    lines = [line for line, _ in direct_collectives(source)]
    assert lines == [6, 7, 8, 9, 10, 11, 12, 13, 14], direct_collectives(source)
