"""``ts.nn.parallel.fully_shard``: torch's FSDP2 (fully_shard) over the
data-parallel dimension of a tensor-parallel model, for either layout.

A tensor-parallel shard may only be sharded again over the ranks that hold
the same shard, its data-parallel group; replicated parameters may be sharded
over any ranks that compute the same gradient average. So every layer that
holds shards becomes its own FSDP unit over the "dp" dimension of the mesh,
and the rest of the model (the root unit, and the ``units`` the caller names)
is sharded over the "dp" dimension ("2d") or over the whole world ("hybrid").
Both are exact, as the DDP layouts are (see distributed.py): FSDP averages
gradients over its mesh as DDP does over its process group.
"""
from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ...distributed import collectives
from ...distributed import state
from ...utils.fsdp_detection import fully_sharded_part
from ...utils.shard_facts import named_parameter_shards, register_shard, registered_shards
from .distributed import HYBRID, LAYOUTS, TWO_D, _broadcast_from_first_rank

#: Methods of tensor-parallel layers that stand for forward (the fused loss calls them).
FORWARD_METHODS = ("linear_cross_entropy",)


def fully_shard(model: nn.Module, mesh: Optional[DeviceMesh] = None, *, layout: str = TWO_D,
                units: Sequence[nn.Module] = (), **fsdp_kwargs) -> nn.Module:
    """Applies torch's ``fully_shard`` to ``model`` (in place; returns it).

    Every module that holds tensor-parallel shards (ParallelLinear,
    ParallelEmbedding, ...) becomes an FSDP unit over ``mesh["dp"]``, with the
    methods that stand for its forward (``linear_cross_entropy``, which
    ParallelLinearCrossEntropyLoss calls) registered with
    register_fsdp_forward_method. Then each of ``units`` (the caller's blocks,
    e.g. transformer layers, innermost first) and last ``model`` itself become
    units over ``mesh["dp"]`` (``layout="2d"``: every rank of a
    tensor-parallel group sees the same samples, ts.utils.data.DistributedGroupSampler)
    or over the world (``layout="hybrid"``: every rank its own samples, the
    batch gathered with ``ts.distributed.gather(x, dim=0)`` before the
    sharded layers). Before that, replicated parameters and buffers are
    broadcast from global rank 0 and shards from the first rank of their
    data-parallel group, as DDP would (fully_shard does not), and shards
    marked only on the tensor (``register_parallel_dim``) are recorded on their
    layer, so that checkpoints still know them once fully_shard has replaced
    the tensors.

    Args:
        model: the tensor-parallel model, not yet under fully_shard or DDP.
        mesh: the 2-D DeviceMesh ("dp", "tp") over shardtorch's groups
            (default ``ts.distributed.device_mesh()`` for the model's device).
        layout: "2d" (default) or "hybrid".
        units: submodules of ``model`` to shard as units of their own (over
            the root's mesh); they must not themselves hold shards.
        **fsdp_kwargs: passed to every fully_shard call (reshard_after_forward,
            mp_policy, offload_policy, ...), except ``mesh``.
    """
    # Imported here, not with shardtorch: torch.distributed.fsdp imports DTensor (utils/fsdp_detection.py).
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method

    what = "ts.nn.parallel.fully_shard"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what}: model must be a torch.nn.Module, got {type(model).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"{what}: layout must be one of {LAYOUTS}, got {layout!r}")
    state._require(what)
    already = fully_sharded_part(model)
    if already:
        raise ValueError(f"{what}: model is already under fully_shard ({already})")
    if any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in model.modules()):
        raise TypeError(f"{what}: model is wrapped in DistributedDataParallel; use one of DDP or fully_shard")
    device_type = _device_type(model)
    mesh = _checked_mesh(mesh, device_type, what)
    _record_tensor_marks(model, what)
    layers = _tensor_parallel_layers(model)
    units = _checked_units(model, units, layers, what)
    if layout == HYBRID and model in layers:
        raise ValueError(f"{what}: under layout 'hybrid' the model itself must not hold tensor-parallel shards "
                         f"(its shards go over 'dp', its other parameters over the world); put its "
                         f"tensor-parallel layers in submodules")
    _broadcast_replicas(model)

    data_parallel = mesh["dp"]
    root_mesh = data_parallel if layout == TWO_D else _world_mesh(device_type)
    for group in _tied_groups(model, layers):
        # One unit per set of modules that share a parameter (a tied LM head and its embedding): FSDP2 manages
        # each parameter in exactly one unit.
        torch_fully_shard(group[0] if len(group) == 1 else group, mesh=data_parallel, **fsdp_kwargs)
        for layer in group:
            for method in FORWARD_METHODS:
                if hasattr(layer, method):
                    register_fsdp_forward_method(layer, method)
    for unit in units:
        torch_fully_shard(unit, mesh=root_mesh, **fsdp_kwargs)
    torch_fully_shard(model, mesh=data_parallel if model in layers else root_mesh, **fsdp_kwargs)
    if model in layers:
        for method in FORWARD_METHODS:
            if hasattr(model, method):
                register_fsdp_forward_method(model, method)
    return model


def _device_type(model: nn.Module) -> str:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _checked_mesh(mesh: Optional[DeviceMesh], device_type: str, what: str) -> DeviceMesh:
    if mesh is None:
        return state.device_mesh(device_type)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh must be a torch DeviceMesh (ts.distributed.device_mesh()), "
                        f"got {type(mesh).__name__}")
    if tuple(mesh.mesh_dim_names or ()) != ("dp", "tp"):
        raise ValueError(f"{what}: mesh must be 2-D with dims ('dp', 'tp'), got {mesh.ndim}-D with names "
                         f"{mesh.mesh_dim_names}")
    for name in ("dp", "tp"):
        ranks = dist.get_process_group_ranks(mesh.get_group(name))
        if ranks != state.get_group_ranks(name):
            raise ValueError(f"{what}: the mesh's {name!r} group has ranks {ranks}, shardtorch's {name!r} group "
                             f"{state.get_group_ranks(name)}: use ts.distributed.device_mesh(), or "
                             f"ts.distributed.init_process_group(mesh=...) with this mesh")
    return mesh


def _world_mesh(device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(state.get_group(state.WORLD), device_type)


def _record_tensor_marks(model: nn.Module, what: str) -> None:
    """Shards known only from a mark on the tensor, which fully_shard's
    DTensors do not carry, recorded on their layer with the whole size (one
    sum over the group per such parameter, in the same order on every rank)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, parameter, spec in named_parameter_shards(model):
        if spec.group != state.TENSOR_PARALLEL:
            raise NotImplementedError(f"{what}: parameter {name!r} is sharded over group {spec.group!r}; only "
                                      f"shards over {state.TENSOR_PARALLEL!r} can be sharded again over 'dp'")
        owner_name, _, short = name.rpartition(".")
        owner = modules[owner_name]
        if spec.full_size is not None or short in registered_shards(owner):
            continue
        size = torch.tensor([parameter.shape[spec.dim]], dtype=torch.int64)
        collectives.all_reduce(size, group=state.get_group(spec.group))
        register_shard(owner, short, spec.dim, int(size.item()), spec.group)


def _tensor_parallel_layers(model: nn.Module) -> List[nn.Module]:
    """The modules that hold shards themselves, innermost first."""
    holders = {id(m) for m in _owners(model)}
    ordered = [m for m in model.modules() if id(m) in holders]
    return ordered[::-1]


def _owners(model: nn.Module) -> Iterable[nn.Module]:
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, _, _ in named_parameter_shards(model):
        yield modules[name.rpartition(".")[0]]


def _tied_groups(model: nn.Module, layers: List[nn.Module]) -> List[List[nn.Module]]:
    """The shard-holding layers (not ``model``), each with every other module
    that holds one of its parameters itself (a tied LM head holds its
    embedding's weight), as groups in the layers' order, innermost first."""
    holders: dict = {}  # id(parameter) -> the modules that hold it directly
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            holders.setdefault(id(parameter), []).append(module)
    placed, groups = {id(model)}, []
    for layer in layers:
        if id(layer) in placed:
            continue
        group, pending = [], [layer]
        while pending:
            module = pending.pop()
            if id(module) in placed:
                continue
            placed.add(id(module))
            group.append(module)
            for parameter in module.parameters(recurse=False):
                pending.extend(holders[id(parameter)])
        groups.append(group)
    return groups


def _checked_units(model: nn.Module, units: Sequence[nn.Module], layers: List[nn.Module], what: str):
    inside = {id(m) for m in model.modules()}
    held = {id(m) for m in layers}
    result = []
    for i, unit in enumerate(units):
        if not isinstance(unit, nn.Module) or id(unit) not in inside or unit is model:
            raise ValueError(f"{what}: units[{i}] must be a submodule of model (not model itself), "
                             f"got {type(unit).__name__}")
        if id(unit) in held:
            raise ValueError(f"{what}: units[{i}] ({type(unit).__name__}) holds tensor-parallel shards itself; "
                             f"it is sharded over 'dp' on its own, leave it out of units")
        result.append(unit)
    # Innermost first, as fully_shard requires.
    depth = {id(m): n.count(".") + 1 if n else 0 for n, m in model.named_modules()}
    return sorted(result, key=lambda m: -depth[id(m)])


@torch.no_grad()
def _broadcast_replicas(model: nn.Module) -> None:
    shards = {id(p) for _, p, _ in named_parameter_shards(model)}
    replicated = [p for p in model.parameters() if id(p) not in shards] + list(model.buffers())
    _broadcast_from_first_rank(replicated, state.get_group(state.WORLD))
    _broadcast_from_first_rank([p for p in model.parameters() if id(p) in shards], state.get_data_parallel_group())
