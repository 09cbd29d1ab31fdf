"""State-dict entries of models under torch's fully_shard (FSDP2).

fully_shard replaces each parameter by a DTensor sharded over the mesh it was
given (Shard(0) over the data-parallel group, as ts.nn.parallel.fully_shard
does): its shape is what the rank would hold without fully_shard (for a
tensor-parallel shard, the whole shard), its local tensor a data-parallel
slice of that. The optimizer's state follows the parameters.

The checkpoint functions work on what the rank would hold without
fully_shard: ``whole_shard`` gathers an entry back over its mesh (collective
over that mesh: every rank calls it for the same entries in the same order),
and ``in_model_form`` cuts a tensor of that shape into the DTensor the model
(or its optimizer) loads, without communication. One entry at a time, so a
rank holds at most one whole shard beyond its own slices.

A tensor-parallel shard may only be sharded again over ranks that hold the
same shard (its data-parallel group): over any other ranks, fully_shard would
mix different shards, and no checkpoint of it can be right, so
``check_mesh`` refuses it, naming the parameter and the ranks.
"""
from typing import List, Optional, Tuple

import torch

from ..utils.fsdp_detection import is_dtensor

#: (mesh, placements) of a DTensor entry.
Spec = Tuple[object, tuple]


def dtensor_spec(value) -> Optional[Spec]:
    """(mesh, placements) when ``value`` is a DTensor (an entry under fully_shard), else None."""
    if is_dtensor(value):
        return value.device_mesh, tuple(value.placements)
    return None


def whole_shard(value):
    """The tensor this rank would hold without fully_shard (``value`` itself
    when it is not a DTensor). Collective over the DTensor's mesh."""
    if is_dtensor(value):
        return value.detach().full_tensor()
    return value


def in_model_form(tensor: torch.Tensor, spec: Optional[Spec]):
    """``tensor`` (shaped as the rank would hold it without fully_shard) as
    the model's entry: unchanged without a spec, else this rank's slice as a
    DTensor placed as ``spec`` says (no communication)."""
    if spec is None or not torch.is_tensor(tensor):
        return tensor
    # A spec comes from a DTensor: its module is loaded already.
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh, placements = spec
    result = distribute_tensor(tensor, mesh, placements, src_data_rank=None)
    local = result.to_local()
    if local.numel() and local.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        # A view would keep the whole shard alive as long as the slice (an
        # optimizer keeps the tensors it loads): own a copy.
        result = DTensor.from_local(local.clone(), mesh, placements, run_check=False,
                                    shape=result.shape, stride=result.stride())
    return result


def mesh_ranks(spec: Spec) -> List[int]:
    """The global ranks of this rank's copy of the mesh."""
    return [int(r) for r in spec[0].mesh.flatten().tolist()]


def check_mesh(key: str, spec: Optional[Spec], group: Optional[str], same_shard_ranks: List[int]) -> None:
    """Raises when ``key``, sharded over ``group``, is sharded by fully_shard
    over ranks that do not all hold the same shard (``same_shard_ranks``:
    this rank's data-parallel group for the tensor-parallel group)."""
    if spec is None or group is None:
        return
    ranks = mesh_ranks(spec)
    if not set(ranks) <= set(same_shard_ranks):
        raise ValueError(
            f"{key!r} is a shard over group {group!r}, and fully_shard shards it again over ranks {ranks}, "
            f"which hold different shards of it: only the ranks that hold the same shard {same_shard_ranks} "
            f"(the data-parallel group) may share it. Give fully_shard the data-parallel mesh "
            f"(ts.distributed.device_mesh()['dp']) for tensor-parallel layers, or use "
            f"ts.nn.parallel.fully_shard(model)")
