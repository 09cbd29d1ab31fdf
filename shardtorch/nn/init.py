"""Initialising shards exactly as torch.nn.Linear would, without the full weight.

torch.nn.Linear draws its weight with ``uniform_`` on the CPU generator, one
number per element in row-major order, then its bias. Drawing the same matrix
chunk by chunk (whole rows at a time) consumes the generator identically, so
each rank can keep just its slice and throw the rest away: the shard equals the
slice of ``torch.nn.Linear(in, out)`` made under the same ``torch.manual_seed``,
bitwise, and the generator ends in the same state.

Peak extra memory while constructing: one chunk of
``max(in_features, CHUNK_ELEMENTS)`` elements of the parameter dtype
(``CHUNK_ELEMENTS = 2**20``, 4 MiB in float32), whatever out_features is.
Shards for other devices are drawn on the CPU generator into a CPU tensor of the
shard's shape, then copied (they equal ``torch.nn.Linear(...)`` built on the
CPU, then moved): see ``draw_on_cpu_``.
"""
from typing import Callable, Optional

import torch

from .. import _C
from ..distributed import collectives
from ..distributed import state
from ..utils.parallel_dim import PARALLEL_DIM_ATTR, parameter_split_dim
from ..utils.shards import shard_range

# The one chunk size of every initialiser (linear, embedding, margin): read at
# each call, never imported by value, so that tests may change it here.
CHUNK_ELEMENTS = 1 << 20


@torch.no_grad()
def draw_on_cpu_(fill: Callable[..., None], *tensors: Optional[torch.Tensor]) -> None:
    """Runs ``fill(*tensors)``, which draws on the CPU generator as torch.nn's
    layers do: on the tensors themselves when they live on the CPU, else on
    CPU tensors of their shapes and dtypes whose values are then copied to
    them. Tensors on the meta device hold no values: nothing happens. None
    entries (an absent bias) stay None."""
    present = [t for t in tensors if t is not None]
    if any(t.device.type == "meta" for t in present):
        return
    if all(t.device.type == "cpu" for t in present):
        fill(*tensors)
        return
    staged = [None if t is None else torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    fill(*staged)
    for tensor, values in zip(tensors, staged):
        if tensor is not None:
            tensor.copy_(values)


def init_linear_shard_(weight: torch.Tensor, bias, in_features: int, out_features: int,
                       out_range=None, in_range=None) -> None:
    """Fills ``weight`` (rows ``out_range``, columns ``in_range`` of the full
    [out_features, in_features] matrix) and ``bias`` (``out_range`` of the full
    bias, or all of it when ``bias.numel() == out_features``) as torch.nn.Linear.

    The C++ core does the drawing (csrc/nn/init.cpp, the same code as the C++
    ParallelLinear), so Python and C++ shards agree by construction; it reads
    ``CHUNK_ELEMENTS`` at each call, so tests may change it."""
    out_range = tuple(out_range or (0, out_features))
    in_range = tuple(in_range or (0, in_features))
    _C.init_linear_shard_(weight, bias, in_features, out_features, out_range, in_range,
                          CHUNK_ELEMENTS)


def shard_init_helper_(init_method: Callable[..., object], tensor: torch.Tensor, **kwargs) -> None:
    """TorchShard's helper: initialises a shard as ``init_method(full, **kwargs)``
    initialises the whole tensor, then keeps this rank's slice.

    The whole tensor is drawn on rank 0 of the world and broadcast to every
    rank (so every data-parallel replica starts the same, as in TorchShard).
    Which dimension was split is read from the tensor's parallel mark
    (TorchShard's meaning, ``shardtorch.utils.parallel_dim.parameter_split_dim``,
    the ``order_type`` honoured); the whole length is the sum of the group's
    shards (uneven shards follow the split rule). A tensor without the mark
    attribute is initialised in place by ``init_method`` alone; one that has
    it, even as None (the parameters of a ParallelLinear(dim=None), the whole
    bias of a row-parallel layer), is drawn and broadcast, as in TorchShard."""
    if not hasattr(tensor, PARALLEL_DIM_ATTR):
        init_method(tensor, **kwargs)
        return
    split = parameter_split_dim(tensor, "shard_init_helper_: tensor")
    shape = list(tensor.shape)
    rank, size = state.get_group_rank(), state.get_group_size()
    if split is not None:
        local = torch.tensor([shape[split]], dtype=torch.int64)
        collectives.all_reduce(local, group=state.get_group())
        shape[split] = int(local)
    with torch.no_grad():
        full = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        init_method(full, **kwargs)
        if state.get_world_size() > 1:
            collectives.broadcast(full, src=0)
        if split is not None:
            start, stop = shard_range(shape[split], size, rank)
            full = full.narrow(split, start, stop - start)
        if tuple(full.shape) != tuple(tensor.shape):
            raise ValueError(f"shard_init_helper_: this rank's slice of the whole {tuple(shape)} tensor is "
                             f"{tuple(full.shape)}, but the tensor is {tuple(tensor.shape)}: its shard does "
                             f"not follow the split rule")
        tensor.copy_(full)
