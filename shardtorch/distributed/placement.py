"""Where the tensor-parallel groups land: a warning when a group spans nodes.

Tensor-parallel ranks are consecutive, so a group stays inside one node only
when the group size divides the processes of every node (torchrun gives each
node consecutive ranks). A group that spans nodes sends every layer's
collectives over the network; that is legal, and slow, so it is said once, on
rank 0, with the layout.

A node is a torchrun agent (its node rank, GROUP_RANK) where torchrun started
the process, else a host name.
"""
import os
import socket
import warnings
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist

from . import collectives


class PlacementWarning(UserWarning):
    """A tensor-parallel group spans more than one node."""


_warned: set = set()


def node_of_this_process() -> str:
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        return f"node {group_rank}"
    return socket.gethostname()


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    ranks = sorted(ranks)
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def describe_spanning_groups(nodes: Sequence[str], groups: Sequence[Sequence[int]]) -> Optional[str]:
    """None when every group lies inside one node; else the layout in words:
    which ranks share each node and which groups span nodes. ``nodes[r]`` is
    rank r's node."""
    spanning = [list(g) for g in groups if len({nodes[r] for r in g}) > 1]
    if not spanning:
        return None
    members: Dict[str, List[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    group_size = len(groups[0])
    sizes = sorted({len(ranks) for ranks in members.values()})
    layout = "; ".join(f"{node}: ranks {_ranges(ranks)}" for node, ranks in members.items())
    listed = ", ".join("{" + ", ".join(map(str, g)) + "}" for g in spanning[:8])
    more = f" and {len(spanning) - 8} more" if len(spanning) > 8 else ""
    return (f"shardtorch: {len(spanning)} of {len(groups)} tensor-parallel groups of {group_size} ranks span "
            f"nodes, so their layers' collectives cross the network: {listed}{more}. Nodes: {layout}. "
            f"Tensor-parallel ranks are consecutive; choose a group size that divides the processes per node "
            f"({'/'.join(map(str, sizes))} here) to keep each group inside one node (docs/placement.md).")


def warn_if_groups_span_nodes(world_group: dist.ProcessGroup, groups: Sequence[Sequence[int]]) -> None:
    """Gathers every rank's node (one small all-gather over the world) and
    warns on rank 0, once per layout, when a tensor-parallel group spans nodes."""
    world = dist.get_world_size(world_group)
    if world == 1 or len(groups[0]) == 1:
        return
    nodes: List[Optional[str]] = [None] * world
    collectives.all_gather_object(nodes, node_of_this_process(), group=world_group)
    message = describe_spanning_groups(nodes, groups)
    if message is None or dist.get_rank() != 0 or message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, PlacementWarning, stacklevel=3)
