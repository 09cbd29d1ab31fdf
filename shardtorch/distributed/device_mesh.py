"""shardtorch's groups as torch's DeviceMesh, and a DeviceMesh as shardtorch's
groups: one set of communicators for fully_shard, DTensor and shardtorch.

The mesh has dims ("dp", "tp"): row i holds the tensor-parallel group
{i*tp, ..., i*tp + tp - 1}, column j the data-parallel group of tensor-parallel
rank j, exactly the groups init_process_group(group_size=tp) creates."""
from typing import List

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIM_NAMES = ("dp", "tp")


def layout(world: int, tp: int) -> torch.Tensor:
    """The global ranks of shardtorch's layout as a (dp, tp) table."""
    return torch.arange(world).reshape(world // tp, tp)


def mesh_from_groups(dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup, world: int, tp: int,
                     device_type: str) -> DeviceMesh:
    mesh = DeviceMesh.from_group([dp_group, tp_group], device_type, mesh=layout(world, tp),
                                 mesh_dim_names=DIM_NAMES)
    row, column = divmod(dist.get_rank(), tp)
    check_groups_agree(mesh, mesh.mesh[row].tolist(), mesh.mesh[:, column].tolist(), "device_mesh")
    return mesh


def check_groups_agree(mesh: DeviceMesh, tp_ranks: List[int], dp_ranks: List[int], what: str) -> None:
    """The mesh's "tp" and "dp" process groups hold exactly the ranks of this
    rank's row and column of the layout (DeviceMesh.from_group does not check
    that the groups it is given match the table)."""
    for name, expected in (("tp", tp_ranks), ("dp", dp_ranks)):
        actual = dist.get_process_group_ranks(mesh.get_group(name))
        if sorted(actual) != sorted(expected):
            raise ValueError(f"{what}: the mesh's {name!r} process group holds ranks {actual}, but its table "
                             f"{mesh.mesh.tolist()} puts rank {dist.get_rank()} with {expected} along {name!r}")


def groups_from_mesh(mesh: DeviceMesh, world: int, rank: int):
    """(tp size, tp group, tp ranks, dp group, dp ranks) of a 2-D mesh with
    dims "dp" and "tp" laid out as shardtorch lays out its groups."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"init_process_group: mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or sorted(names) != sorted(DIM_NAMES):
        raise ValueError(f"init_process_group: mesh must be 2-D with dims named 'dp' and 'tp' (as from "
                         f"init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))), got {mesh.ndim}-D "
                         f"with names {names}")
    table = mesh.mesh if names == DIM_NAMES else mesh.mesh.t()
    tp = table.size(1)
    if table.numel() != world or not torch.equal(table.cpu(), layout(world, tp)):
        raise ValueError(f"init_process_group: the mesh's tensor-parallel groups must be consecutive ranks, "
                         f"as shardtorch's are (dp x tp table {layout(world, tp).tolist()}), got the table "
                         f"{table.tolist()} for world size {world}")
    row, column = divmod(rank, tp)
    tp_ranks: List[int] = table[row].tolist()
    dp_ranks: List[int] = table[:, column].tolist()
    check_groups_agree(mesh, tp_ranks, dp_ranks, "init_process_group")
    return tp, mesh.get_group("tp"), tp_ranks, mesh.get_group("dp"), dp_ranks
