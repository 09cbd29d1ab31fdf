"""The one collective layer of the Python package: every collective that shardtorch/ makes outside
the shard ops (checkpoint transfers and verdicts, the loader's and the proof's agreements, the
layers' initial broadcast in nn/init.py, the adapter save's barrier, the logits' shard service's
addresses, the FSDP layouts, the sharded-gradient hook, the margin loss's replica labels, the
placement check) goes through the functions below, with torch.distributed's signatures (ranks
``src`` and ``dst`` are global ranks; ``group`` is a ProcessGroup or None), plus a shardtorch
group's name for ``group``. tests/unit/test_one_collective_layer.py holds the rule that no other
module of shardtorch/ calls a torch.distributed collective.

What goes where:

- A group shardtorch registered (``init_process_group``'s "tp", "dp" and "world", a mesh's groups,
  ``ts.distributed.register_group``'s), given by its name, by its ProcessGroup
  (``state.get_group(name)``) or as None (the world: torch.distributed's default group), goes
  through the C++ communicators of ``csrc/comm`` (``comm/registry.h``), the same objects the shard
  ops use, one per group and device:
  CUDA tensors through NCCL called directly (its watchdog, ``SHARDTORCH_ON_COMM_FAILURE``, and the
  deferred checks' count of the group's collectives, which these collectives advance like the ops'
  ones); CPU tensors through the group's CPU process group (Gloo), or, up to 1 MiB per rank among
  ranks of one host, the shared-memory segment; under ``SHARDTORCH_DEBUG=1`` every rank first
  checks that all call the same collective with the same sizes.
- ``send`` and ``recv`` of CUDA tensors go to torch.distributed (c10d's NCCL communicator per pair
  of ranks; why: ``_point_to_point_group``).
- Anything else goes to torch.distributed unchanged: calls made before ``init_process_group`` or
  after ``destroy_process_group`` (the checkpoint functions under a plain torch.distributed), and
  a ProcessGroup shardtorch was never given.
- Not here: the collectives torch's own code makes when shardtorch calls it (DDP's reducer, FSDP2,
  DTensor's ``full_tensor`` / ``distribute_tensor`` in checkpoint/dtensor_entries.py, DCP's
  ``save`` / ``load``, ZeroRedundancyOptimizer's ``consolidate_state_dict``): they run on c10d's
  backends of the same groups (docs/cuda.md, "One collective layer").

Object collectives pickle into uint8 tensors and move them with the tensor collectives above
(each rank's length first, one int64 per rank, then the bytes padded to the longest), on the CPU
where the group has a CPU backend, else on the current CUDA device. ``all_reduce(op="max")`` is an
all-gather and a max on every rank: the communicators only sum, and the maxima here are flags and
errors of one element. ``barrier`` is an all-reduce of one element that the host reads.
all_gather, broadcast, send and recv move tensors of dtypes the communicators lack (bool buffers,
complex, float8) as their bytes.
"""
import pickle
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import _C

# The name shardtorch registers over every rank (state.WORLD): where group=None goes.
_WORLD = "world"

# name -> (ProcessGroup, global ranks in group rank order)
_groups: Dict[str, Tuple[dist.ProcessGroup, List[int]]] = {}

Group = Union[None, str, dist.ProcessGroup]


def register_group(name: str, group: dist.ProcessGroup, ranks: List[int]) -> None:
    """Registers ``group`` under ``name`` with the C++ core (for the ops and for this layer)."""
    _C.register_group(name, group.group_name, list(ranks))
    _groups[name] = (group, list(ranks))


def forget_groups() -> None:
    """Drops every registered group (their communicators with them)."""
    _groups.clear()
    _C.clear_groups()


def _name_of(group: Group, what: str) -> Optional[str]:
    """The registered name ``group`` goes through, or None for torch.distributed."""
    if group is None:
        return _WORLD if _WORLD in _groups else None
    if isinstance(group, str):
        if group not in _groups:
            raise ValueError(f"shardtorch.distributed.collectives.{what}: unknown group {group!r}; known: "
                             f"{sorted(_groups)}")
        return group
    # Registration order: shardtorch's own names first where one ProcessGroup has two.
    return next((name for name, (registered, _) in _groups.items() if registered is group), None)


def _group_rank(name: str, rank: int, what: str, argument: str) -> int:
    ranks = _groups[name][1]
    if rank not in ranks:
        raise ValueError(f"shardtorch.distributed.collectives.{what}: {argument} must be a global rank of group "
                         f"{name!r} (ranks {ranks}), got {rank}")
    return ranks.index(rank)


# The dtypes every communicator moves (NCCL's list); collectives that only move values (not
# all_reduce) carry the others as their bytes: a model's bool buffers, complex or float8 tensors.
_NATIVE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
           torch.int8}


def _movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous), or a uint8 view of its bytes where its dtype is not one of _NATIVE."""
    return tensor if tensor.dtype in _NATIVE else tensor.view(-1).view(torch.uint8)


def _in_place(tensor: torch.Tensor, collective) -> None:
    """Runs ``collective`` on ``tensor``, through a contiguous copy where it is not contiguous."""
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    collective(work)
    if work is not tensor:
        tensor.copy_(work)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Group = None) -> None:
    """``tensor`` becomes its sum (``op="sum"``) or maximum (``op="max"``) over the group, in place."""
    if op not in ("sum", "max"):
        raise ValueError(f"shardtorch.distributed.collectives.all_reduce: op must be 'sum' or 'max', got {op!r}")
    name = _name_of(group, "all_reduce")
    if name is None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    elif op == "sum":
        _in_place(tensor, lambda work: _C.all_reduce(work, name))
    else:
        tensor.copy_(_gathered(tensor, name).amax(0))


def _gathered(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """[group size, *tensor.shape]: every group rank's ``tensor``, in group rank order."""
    output = torch.empty((len(_groups[name][1]),) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
    _C.all_gather(_movable(tensor.contiguous()), _movable(output), name)
    return output


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Group = None) -> None:
    """``tensor_list[r]`` becomes group rank r's ``tensor`` (the same shape on every rank)."""
    name = _name_of(group, "all_gather")
    if name is None:
        dist.all_gather(tensor_list, tensor, group=group)
        return
    if len(tensor_list) != len(_groups[name][1]):
        raise ValueError(f"shardtorch.distributed.collectives.all_gather: tensor_list must hold one tensor per rank "
                         f"of group {name!r} ({len(_groups[name][1])}), got {len(tensor_list)}")
    for slot, block in zip(tensor_list, _gathered(tensor, name)):
        slot.copy_(block)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None) -> None:
    """``tensor`` becomes global rank ``src``'s, in place."""
    name = _name_of(group, "broadcast")
    if name is None:
        dist.broadcast(tensor, src, group=group)
        return
    root = _group_rank(name, src, "broadcast", "src")
    _in_place(tensor, lambda work: _C.broadcast(_movable(work), root, name))


def _point_to_point_group(group: Group, name: Optional[str]) -> Optional[dist.ProcessGroup]:
    """The ProcessGroup torch.distributed takes for ``group``.

    Why CUDA send/recv go there: shardtorch's NCCL communicator of a group is created by every rank
    of the group at its first CUDA collective on that device (ncclCommInitRank waits for all of
    them), but a point-to-point transfer involves two: the checkpoint transfers' sends to rank 0
    over the world, which the ranks of other tensor-parallel groups never join, would wait forever
    for that creation. c10d makes a communicator per pair of ranks for them instead."""
    return _groups[name][0] if isinstance(group, str) else group


def send(tensor: torch.Tensor, dst: int, group: Group = None) -> None:
    """Sends ``tensor`` to global rank ``dst``, which receives it with ``recv``."""
    name = _name_of(group, "send")
    if name is None or tensor.is_cuda:  # CUDA: c10d's pairwise communicators (_point_to_point_group)
        dist.send(tensor, dst, group=_point_to_point_group(group, name))
        return
    _C.send(_movable(tensor.contiguous()), _group_rank(name, dst, "send", "dst"), name)


def recv(tensor: torch.Tensor, src: int, group: Group = None) -> None:
    """``tensor`` becomes what global rank ``src`` sends, in place."""
    name = _name_of(group, "recv")
    if name is None or tensor.is_cuda:
        dist.recv(tensor, src, group=_point_to_point_group(group, name))
        return
    peer = _group_rank(name, src, "recv", "src")
    _in_place(tensor, lambda work: _C.recv(_movable(work), peer, name))


def barrier(group: Group = None) -> None:
    """Returns once every rank of the group has called it."""
    name = _name_of(group, "barrier")
    if name is None:
        dist.barrier(group=group)
        return
    token = torch.zeros(1, device=_object_device(name))
    _C.all_reduce(token, name)
    token.item()  # on CUDA the all-reduce only orders the stream: the host waits for it here


def _object_device(name: str) -> torch.device:
    if _C.group_has_cpu_backend(name):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _to_bytes(obj, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(data: torch.Tensor):
    return pickle.loads(data.cpu().numpy().tobytes())


def all_gather_object(object_list: list, obj, group: Group = None) -> None:
    """``object_list[r]`` becomes group rank r's ``obj`` (any picklable value)."""
    name = _name_of(group, "all_gather_object")
    if name is None:
        dist.all_gather_object(object_list, obj, group=group)
        return
    size = len(_groups[name][1])
    if len(object_list) != size:
        raise ValueError(f"shardtorch.distributed.collectives.all_gather_object: object_list must hold one entry per "
                         f"rank of group {name!r} ({size}), got {len(object_list)}")
    data = _to_bytes(obj, _object_device(name))
    lengths = _gathered(torch.tensor([data.numel()], dtype=torch.int64, device=data.device), name).view(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=data.device)
    padded[:data.numel()] = data
    for rank, (block, length) in enumerate(zip(_gathered(padded, name), lengths)):
        object_list[rank] = _from_bytes(block[:length])


def broadcast_object_list(object_list: list, src: int = 0, group: Group = None) -> None:
    """``object_list`` becomes global rank ``src``'s list (its entries, any picklable values)."""
    name = _name_of(group, "broadcast_object_list")
    if name is None:
        dist.broadcast_object_list(object_list, src=src, group=group)
        return
    root = _group_rank(name, src, "broadcast_object_list", "src")
    device = _object_device(name)
    mine = _groups[name][1].index(dist.get_rank()) == root
    data = _to_bytes(list(object_list), device) if mine else None
    length = torch.tensor([data.numel() if mine else 0], dtype=torch.int64, device=device)
    _C.broadcast(length, root, name)
    if not mine:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    _C.broadcast(data, root, name)
    object_list[:] = _from_bytes(data)
