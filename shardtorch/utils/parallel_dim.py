"""The parallel mark on tensors, with TorchShard's public meaning.

``tensor.parallel_dim`` says how a tensor was produced by the parallel
layers, in the layer's terms (TorchShard 0.1.0's ``torchshard._PARALLEL_DIM``):

- on an activation: 1 or -1, produced the column-parallel way (sharded on its
  last dimension); 0, produced the row-parallel way (whole); None (or no mark),
  not parallel. A column-parallel output also carries ``parallel_full_size``,
  the length of the whole tensor along its last dimension, so that the
  parallel loss knows the number of classes without asking its peers.
- on a parameter: the ``dim`` of the layer that owns it, a dimension of the
  layer's [in_features, out_features] view, together with ``order_type``
  (``torchshard._ORDER_ATTR``): 0 (default) when the parameter stores that
  view reversed (a Linear weight is [out, in]), 1 when in the same order (an
  Embedding table, [num_embeddings, embedding_dim], marked with its own dim).
  ``parameter_split_dim`` translates this into the dimension of the parameter
  tensor that was split, exactly as TorchShard's checkpoint code does; it is
  the one place where the mark of a parameter is read.

shardtorch's own layers also record their shard facts on themselves
(shardtorch.utils.shard_facts), which survive wrappers that replace tensors;
the tensor marks are for code written TorchShard's way.
"""
from typing import Optional

import torch

#: Attribute names, as TorchShard's ``torchshard._PARALLEL_DIM`` and ``_ORDER_ATTR``.
PARALLEL_DIM_ATTR = "parallel_dim"
ORDER_ATTR = "order_type"
FULL_SIZE_ATTR = "parallel_full_size"
_MARKS = (None, 0, 1, -1)


def _check_mark(value, order_type, fn: str) -> None:
    if value not in _MARKS or isinstance(value, bool):
        raise ValueError(f"{fn}: value must be None, 0, 1 or -1 (a dimension of the layer's "
                         f"[in_features, out_features] view, as in TorchShard), got {value!r}")
    if order_type not in (0, 1) or isinstance(order_type, bool):
        raise ValueError(f"{fn}: order_type must be 0 (the tensor stores the layer's view reversed, "
                         f"as a Linear weight) or 1 (in the same order), got {order_type!r}")


def set_attribute(tensor: torch.Tensor, value: Optional[int] = None, order_type: int = 0,
                  full_size: Optional[int] = None) -> torch.Tensor:
    """Marks ``tensor`` with ``parallel_dim = value`` and ``order_type`` (see
    the module docstring); ``full_size``: for a column-parallel activation,
    the whole length along its last dimension (None: not known)."""
    _check_mark(value, order_type, "set_attribute")
    if full_size is not None and (value not in (1, -1) or not isinstance(full_size, int)
                                  or isinstance(full_size, bool) or full_size < 0):
        raise ValueError(f"set_attribute: full_size must be a non-negative int, for a tensor marked "
                         f"1 or -1 (sharded on its last dim), got full_size={full_size!r} with value={value!r}")
    setattr(tensor, PARALLEL_DIM_ATTR, value)
    setattr(tensor, ORDER_ATTR, order_type)
    setattr(tensor, FULL_SIZE_ATTR, full_size)
    return tensor


def register_parallel_attribute(param: torch.Tensor, value: Optional[int] = None,
                                order_type: int = 0) -> torch.Tensor:
    """TorchShard's name for ``set_attribute(param, value, order_type)``."""
    return set_attribute(param, value, order_type)


def register_parallel_dim(tensor: torch.Tensor, value: Optional[int],
                          full_size: Optional[int] = None) -> torch.Tensor:
    """Marks ``tensor`` with ``parallel_dim = value`` (order_type 0), as
    TorchShard's ``register_parallel_dim``; ``full_size`` as in set_attribute."""
    return set_attribute(tensor, value, 0, full_size)


def get_parallel_dim(tensor: torch.Tensor) -> Optional[int]:
    """The mark ``tensor`` carries (None: none)."""
    return getattr(tensor, PARALLEL_DIM_ATTR, None)


def get_order_type(tensor: torch.Tensor) -> int:
    return getattr(tensor, ORDER_ATTR, 0)


def get_parallel_full_size(tensor: torch.Tensor) -> Optional[int]:
    """The whole length along the last dimension of a tensor marked as sharded
    there, or None when it is not so marked or its mark did not say it."""
    if not is_sharded_on_last_dim(tensor):
        return None
    return getattr(tensor, FULL_SIZE_ATTR, None)


def is_sharded_on_last_dim(tensor: torch.Tensor) -> bool:
    """Whether an activation is marked as produced the column-parallel way
    (``parallel_dim`` 1 or -1, TorchShard's meaning). A mark of 0 (a
    row-parallel, whole output) or none is not sharded."""
    return get_parallel_dim(tensor) in (1, -1) and tensor.dim() > 0


def parameter_split_dim(param: torch.Tensor, name: str = "parameter") -> Optional[int]:
    """The dimension of ``param`` that was split, read from its mark
    (``parallel_dim`` and ``order_type``, TorchShard's meaning), or None when
    the parameter is whole.

    As TorchShard: with order_type 0 the tensor stores the layer's [in, out]
    view reversed, so a layer dim of 1 or -1 (column-parallel) split tensor
    dim 0 and a layer dim of 0 (row-parallel) split dim 1 of a matrix and
    nothing of a vector (the whole bias of a row-parallel layer); order_type 1
    swaps the two. A mark that names no dimension of the tensor raises."""
    value, order_type = get_parallel_dim(param), get_order_type(param)
    if value is None:
        return None
    if value not in (0, 1, -1) or isinstance(value, bool) or order_type not in (0, 1):
        raise ValueError(f"{name}: parallel mark must be parallel_dim in (None, 0, 1, -1) with order_type "
                         f"in (0, 1), got parallel_dim={value!r}, order_type={order_type!r}")
    layer_in_dim = value == 0  # the layer's input features (row-parallel)
    # The tensor dim holding the layer's output features (0) or input features (1).
    split = (1 if layer_in_dim else 0) if order_type == 0 else (0 if layer_in_dim else 1)
    if param.dim() == 1:
        # A vector is along the layer's output features (a bias) with
        # order_type 0, along its first dim with order_type 1.
        return 0 if split == 0 else None
    if param.dim() != 2:
        raise ValueError(f"{name}: a parallel mark (parallel_dim={value}, order_type={order_type}) names a "
                         f"dimension of a layer's [in, out] view, which a {param.dim()}-D parameter of shape "
                         f"{tuple(param.shape)} has not; record which tensor dim was split with "
                         f"shardtorch.utils.register_shard on its module instead")
    return split
