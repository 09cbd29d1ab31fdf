"""DeviceMesh interop at world 4 = 2 x 2: the mesh shardtorch hands out is built
on its own groups, a mesh from init_device_mesh becomes shardtorch's groups,
and either way a collective over "tp" or "dp" reaches exactly the ranks the
layout says. Launched with init=False; torch.distributed, once up, stays up
across cases (as the user's own), so that no rank re-creates the store while
another still talks to the old one."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardtorch as ts
from tests.reference import expect_error


def _torch_distributed_up():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")


def _rank_sum(group) -> int:
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return int(total.item())


def _check_layout(mesh):
    """2 x 2, tensor-parallel ranks consecutive: tp {0,1} {2,3}, dp {0,2} {1,3}."""
    rank = dist.get_rank()
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    tp_ranks, dp_ranks = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
    assert ts.distributed.get_group_ranks("tp") == tp_ranks
    assert ts.distributed.get_group_ranks("dp") == dp_ranks
    assert ts.distributed.get_group("tp") is mesh.get_group("tp"), "a second tensor-parallel communicator"
    assert ts.distributed.get_group("dp") is mesh.get_group("dp"), "a second data-parallel communicator"
    assert _rank_sum(mesh.get_group("tp")) == sum(tp_ranks)
    assert _rank_sum(mesh.get_group("dp")) == sum(dp_ranks)
    # shardtorch's own ops run over the same group.
    assert ts.distributed.reduce(torch.tensor([float(rank)], dtype=torch.float64)).item() == sum(tp_ranks)
    # A DTensor sharded over "tp" and replicated over "dp" is whole again.
    full = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    dtensor = distribute_tensor(full, mesh, [Replicate(), Shard(1)])
    assert dtensor.to_local().shape == (4, 3)
    assert torch.equal(dtensor.to_local(), full[:, 3 * (rank % 2):3 * (rank % 2) + 3])
    assert torch.equal(dtensor.full_tensor(), full)


def case_device_mesh_is_built_on_shardtorchs_groups():
    _torch_distributed_up()
    ts.distributed.init_process_group(group_size=2)
    try:
        mesh = ts.distributed.device_mesh("cpu")
        _check_layout(mesh)
        assert ts.distributed.device_mesh("cpu") is mesh, "device_mesh() built a second mesh"
    finally:
        ts.distributed.destroy_process_group()


def case_init_takes_the_groups_of_a_device_mesh():
    _torch_distributed_up()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    try:
        ts.distributed.init_process_group(mesh=mesh)
        _check_layout(mesh)
        assert ts.distributed.device_mesh("cpu") is mesh
        # A sharded layer computes over the mesh's "tp" group.
        torch.manual_seed(0)
        full = torch.nn.Linear(6, 4, dtype=torch.float64)
        layer = ts.nn.ParallelLinear(6, 4, dim=1, dtype=torch.float64)
        rows = slice(2 * (dist.get_rank() % 2), 2 * (dist.get_rank() % 2) + 2)
        with torch.no_grad():
            layer.weight.copy_(full.weight[rows])
            layer.bias.copy_(full.bias[rows])
        x = torch.randn(3, 6, dtype=torch.float64)
        torch.testing.assert_close(ts.distributed.gather(layer(x), dim=-1), full(x), rtol=0, atol=1e-12)
        ts.distributed.destroy_process_group()
        # The mesh's groups (and torch.distributed) are the user's: still usable.
        assert dist.is_initialized()
        assert _rank_sum(mesh.get_group("tp")) == sum(mesh.mesh[dist.get_rank() // 2].tolist())
    finally:
        if ts.distributed.is_initialized():
            ts.distributed.destroy_process_group()


def case_a_mesh_shardtorch_cannot_use_fails_clearly():
    _torch_distributed_up()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expect_error(lambda: ts.distributed.init_process_group(mesh=mesh, group_size=4),
                 "group_size 4 differs from the mesh's 'tp' size 2", exception=ValueError)
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    expect_error(lambda: ts.distributed.init_process_group(mesh=flat),
                 "mesh must be 2-D with dims named 'dp' and 'tp'", "got 1-D", exception=ValueError)
    # dim 0 named "tp": tensor-parallel groups {0, 2} and {1, 3}, not consecutive.
    strided = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    expect_error(lambda: ts.distributed.init_process_group(mesh=strided),
                 "tensor-parallel groups must be consecutive ranks", "[[0, 2], [1, 3]]", exception=ValueError)
    # A mesh whose process groups are not the ones its table names (built
    # from swapped groups: "tp" holds the data-parallel ranks): refused, the
    # groups are checked, not assumed.
    swapped = DeviceMesh.from_group([mesh.get_group("tp"), mesh.get_group("dp")], "cpu",
                                    mesh=torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    expect_error(lambda: ts.distributed.init_process_group(mesh=swapped),
                 "the mesh's 'tp' process group holds ranks", "along 'tp'", exception=ValueError)
    expect_error(lambda: ts.distributed.init_process_group(mesh="2x2"),
                 "mesh must be a torch DeviceMesh, got str", exception=TypeError)
    assert not ts.distributed.is_initialized()
