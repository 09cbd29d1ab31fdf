"""Process groups of shardtorch: the tensor-parallel group of this rank, its
data-parallel group and the world, registered with the C++ core under the
names the ops use ("tp", "dp", "world")."""
import datetime
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import _C
from . import collectives
from .compile_cache import forget_rank_in_compile_caches, key_compile_caches_by_rank
from .device_mesh import DeviceMesh, groups_from_mesh, mesh_from_groups
from .elastic_store import elastic_store
from .placement import warn_if_groups_span_nodes

TENSOR_PARALLEL = "tp"
DATA_PARALLEL = "dp"
WORLD = "world"


def default_timeout() -> datetime.timedelta:
    """300 s, or SHARDTORCH_TIMEOUT seconds: read when a group is made, not at import (as the C++
    API's shardtorch::distributed::default_timeout does), so a value set after ``import shardtorch``
    counts and a bad one fails init_process_group, not the import."""
    value = os.environ.get("SHARDTORCH_TIMEOUT", "")
    if not value:
        return datetime.timedelta(seconds=300)
    try:
        return datetime.timedelta(seconds=int(value))
    except ValueError:
        raise ValueError(f"shardtorch.distributed: SHARDTORCH_TIMEOUT must be a number of seconds, "
                         f"got {value!r}") from None


@dataclass
class _State:
    topology: "_C.TensorParallelTopology"
    groups: Dict[str, dist.ProcessGroup] = field(default_factory=dict)
    ranks: Dict[str, List[int]] = field(default_factory=dict)
    owns_default_group: bool = False
    # False when the groups came from the user's DeviceMesh: not ours to destroy.
    owns_groups: bool = True
    mesh: Optional[DeviceMesh] = None


_state: Optional[_State] = None


def _default_backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def groups_backend(default_config: str) -> Optional[str]:
    """The backend of shardtorch's own groups, given the default group's
    backend config (``torch.distributed.get_backend_config()``, e.g.
    "cuda:nccl"): None to inherit it when it can move CPU tensors; otherwise
    the same with Gloo for CPU added ("cuda:nccl" -> "cpu:gloo,cuda:nccl"), so
    that CPU tensors of the shard ops (and DDP or checkpoints on the CPU) work
    when torch.distributed was started with backend="nccl". CUDA tensors of the
    shard ops use NCCL directly whichever the backend: their communicator's id
    travels through the group's store."""
    entries = [item.strip() for item in default_config.split(",") if item.strip()]
    devices = [item.split(":", 1)[0] for item in entries if ":" in item]
    if "cpu" in devices or not entries:
        return None
    if len(devices) != len(entries):  # one backend for every device, e.g. "mpi"
        return None
    return ",".join(["cpu:gloo"] + entries)


def _new_group_kwargs(timeout: datetime.timedelta) -> dict:
    backend = groups_backend(dist.get_backend_config())
    return {"timeout": timeout} if backend is None else {"timeout": timeout, "backend": backend}


def _indivisible(world: int, group_size: int) -> ValueError:
    return ValueError(f"init_process_group: group_size must divide the world size {world}, got {group_size}")


def init_process_group(group_size: Optional[int] = None, backend: Optional[str] = None,
                       timeout: Optional[datetime.timedelta] = None, mesh: Optional[DeviceMesh] = None) -> None:
    """Creates the tensor-parallel and data-parallel groups.

    Works when torch.distributed is already initialised; otherwise initialises
    it from torchrun's environment (``env://``: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). Tensor-parallel ranks are consecutive: with world 4 and
    ``group_size=2`` the groups are {0, 1} and {2, 3}, the data-parallel groups
    {0, 2} and {1, 3}.

    With ``mesh`` (a 2-D DeviceMesh with dims "dp" and "tp", such as
    ``init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))``),
    shardtorch uses the mesh's own process groups: "tp" as the
    tensor-parallel group, "dp" as the data-parallel group (no second set of
    communicators). Its tensor-parallel groups must be consecutive ranks.

    Args:
        group_size: ranks per tensor-parallel group; must divide the world size
            (default 1, or the mesh's "tp" size).
        backend: torch.distributed backend when this call initialises it
            (default "gloo", or "cpu:gloo,cuda:nccl" when CUDA is available).
            CUDA tensors in shard ops always use NCCL directly. An existing
            torch.distributed of any backend works: under backend="nccl"
            shardtorch's groups get Gloo for CPU tensors too (groups_backend).
        timeout: how long a collective may wait for a peer before failing
            (default 300 s, or SHARDTORCH_TIMEOUT seconds).
        mesh: an existing DeviceMesh to take the groups from.
    """
    global _state
    if mesh is not None:
        _init_from_mesh(mesh, group_size)
        return
    group_size = 1 if group_size is None else group_size
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"init_process_group: group_size must be a positive int, got {group_size!r}")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"init_process_group: timeout must be a datetime.timedelta, got {timeout!r}")
    timeout = timeout or default_timeout()
    owns = False
    if not dist.is_initialized():
        # Refuse a group size that cannot work before anything is created:
        # tearing a fresh torch.distributed down again races with the peers
        # (one may still talk to the store that the other is closing).
        world_env = os.environ.get("WORLD_SIZE", "")
        if world_env.isdigit() and int(world_env) % group_size != 0:
            raise _indivisible(int(world_env), group_size)
        store = elastic_store(timeout)
        if store is not None:
            dist.init_process_group(backend=backend or _default_backend(), store=store,
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timeout)
        else:
            dist.init_process_group(backend=backend or _default_backend(), init_method="env://",
                                    timeout=timeout)
        owns = True
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % group_size != 0:
        if owns:
            dist.destroy_process_group()
        raise _indivisible(world, group_size)
    # A re-init inherits the duty to tear torch.distributed down: read it
    # before destroy_process_group forgets the previous state.
    owns = owns or (_state is not None and _state.owns_default_group)
    if _state is not None:
        destroy_process_group(keep_torch_distributed=True)
    topology = _C.TensorParallelTopology(world, rank, group_size)
    state = _State(topology=topology, owns_default_group=owns)

    # Every rank creates every group, in the same order (torch requires it),
    # with a CPU backend even when the default group has none.
    kwargs = _new_group_kwargs(timeout)
    for ranks in topology.tensor_parallel_groups():
        group = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            state.groups[TENSOR_PARALLEL], state.ranks[TENSOR_PARALLEL] = group, list(ranks)
    for ranks in topology.data_parallel_groups():
        group = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            state.groups[DATA_PARALLEL], state.ranks[DATA_PARALLEL] = group, list(ranks)
    if "backend" in kwargs:  # the default group cannot move CPU tensors: a world group that can
        state.groups[WORLD] = dist.new_group(list(range(world)), **kwargs)
    else:
        state.groups[WORLD] = dist.group.WORLD
    state.ranks[WORLD] = list(range(world))

    for name, group in state.groups.items():
        collectives.register_group(name, group, state.ranks[name])
    _state = state
    key_compile_caches_by_rank(rank, world, state.ranks)
    warn_if_groups_span_nodes(state.groups[WORLD], topology.tensor_parallel_groups())


def _init_from_mesh(mesh: DeviceMesh, group_size: Optional[int]) -> None:
    global _state
    if not dist.is_initialized():
        raise RuntimeError("init_process_group(mesh=...): torch.distributed is not initialised; a DeviceMesh "
                           "needs it (init_device_mesh brings it up)")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, tp_group, tp_ranks, dp_group, dp_ranks = groups_from_mesh(mesh, world, rank)
    if group_size is not None and group_size != tp:
        raise ValueError(f"init_process_group: group_size {group_size} differs from the mesh's 'tp' size {tp}")
    owns = _state is not None and _state.owns_default_group
    if _state is not None:
        destroy_process_group(keep_torch_distributed=True)
    state = _State(topology=_C.TensorParallelTopology(world, rank, tp), owns_default_group=owns,
                   owns_groups=False, mesh=mesh)
    state.groups[TENSOR_PARALLEL], state.ranks[TENSOR_PARALLEL] = tp_group, tp_ranks
    state.groups[DATA_PARALLEL], state.ranks[DATA_PARALLEL] = dp_group, dp_ranks
    state.groups[WORLD], state.ranks[WORLD] = dist.group.WORLD, list(range(world))
    for name, group in state.groups.items():
        collectives.register_group(name, group, state.ranks[name])
    _state = state
    key_compile_caches_by_rank(rank, world, state.ranks)


def device_mesh(device_type: Optional[str] = None) -> DeviceMesh:
    """torch's DeviceMesh with dims ("dp", "tp") over shardtorch's own
    data-parallel and tensor-parallel process groups, for fully_shard and
    DTensor (the mesh given to init_process_group, if one was).

    Args:
        device_type: "cuda" or "cpu" (default: "cuda" when available).
    """
    state = _require("device_mesh")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if state.mesh is None or state.mesh.device_type != device_type:
        state.mesh = mesh_from_groups(state.groups[DATA_PARALLEL], state.groups[TENSOR_PARALLEL],
                                      len(state.ranks[WORLD]), len(state.ranks[TENSOR_PARALLEL]), device_type)
    return state.mesh


def destroy_process_group(keep_torch_distributed: bool = False) -> None:
    """Forgets shardtorch's groups; also tears torch.distributed down when
    init_process_group brought it up (unless keep_torch_distributed)."""
    global _state
    if _state is None:
        return
    # A check that no collective came to give (the last step's loss, on CUDA) raises on every rank,
    # once the groups are gone.
    try:
        _C.check_deferred()
        deferred_error = None
    except RuntimeError as error:
        deferred_error = error
    collectives.forget_groups()
    for name, group in _state.groups.items():
        if group is not dist.group.WORLD and _state.owns_groups and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - best effort while shutting down
                pass
    owns = _state.owns_default_group
    _state = None
    forget_rank_in_compile_caches()
    if owns and not keep_torch_distributed and dist.is_initialized():
        dist.destroy_process_group()
    if deferred_error is not None:
        raise deferred_error


def check_deferred(group: Optional[str] = None) -> None:
    """Raises now, on every rank, what the argument checks deferred on CUDA found (a target out of
    range in the step's loss, bad ``sampled_classes``): on CUDA the host does not wait to read them;
    they come at the group's 8th collective after theirs, at ``destroy_process_group`` at the
    latest, or here. Every rank must call it at the same point, e.g. once per step before reading
    the loss. It waits for the device only if it has not yet made those checks. CPU groups check
    at once: a no-op there. ``group``: one group's name (default: every group)."""
    _require("check_deferred")
    if group is not None and (not isinstance(group, str) or not group):
        raise ValueError(f"check_deferred: group must be a group's name (a non-empty str) or None, got {group!r}")
    _C.check_deferred(group or "")


def register_group(name: str, group: dist.ProcessGroup, ranks: Optional[List[int]] = None) -> None:
    """Makes a torch.distributed group usable by shardtorch under ``name``
    (layers and ops take ``group=name``). ``ranks``: its global ranks in group
    order (default: asked from torch.distributed)."""
    state = _require("register_group")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_group: name must be a non-empty str, got {name!r}")
    if name in (TENSOR_PARALLEL, DATA_PARALLEL, WORLD):
        raise ValueError(f"register_group: {name!r} is reserved for shardtorch's own groups")
    ranks = list(ranks) if ranks is not None else dist.get_process_group_ranks(group)
    collectives.register_group(name, group, ranks)
    state.groups[name], state.ranks[name] = group, ranks
    key_compile_caches_by_rank(dist.get_rank(), dist.get_world_size(), state.ranks)


def is_initialized() -> bool:
    return _state is not None


def _require(what: str) -> _State:
    if _state is None:
        raise RuntimeError(f"shardtorch.distributed.{what}: shardtorch is not initialised; call "
                           "shardtorch.distributed.init_process_group(group_size=...) first")
    return _state


def get_rank() -> int:
    """This process's rank in the world (0 when not distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_group(name: str = TENSOR_PARALLEL) -> dist.ProcessGroup:
    """The torch ProcessGroup behind a shardtorch group name (default: this
    rank's tensor-parallel group)."""
    state = _require("get_group")
    if name not in state.groups:
        raise ValueError(f"get_group: unknown group {name!r}; known: {sorted(state.groups)}")
    return state.groups[name]


def get_group_ranks(name: str = TENSOR_PARALLEL) -> List[int]:
    get_group(name)
    return list(_state.ranks[name])


def get_group_rank(name: str = TENSOR_PARALLEL) -> int:
    return dist.get_rank(get_group(name))


def get_group_size(name: str = TENSOR_PARALLEL) -> int:
    return dist.get_world_size(get_group(name))


def get_data_parallel_group() -> dist.ProcessGroup:
    return get_group(DATA_PARALLEL)


def get_data_parallel_rank() -> int:
    return get_group_rank(DATA_PARALLEL)


def get_data_parallel_size() -> int:
    return get_group_size(DATA_PARALLEL)
