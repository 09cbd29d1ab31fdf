"""Losses over classes split across a tensor-parallel group: TorchShard's
ParallelCrossEntropyLoss over torch.ops.shard.parallel_cross_entropy, and its
fusion with a column-parallel classifier."""
from typing import Optional

import torch
from torch import nn

from ..distributed import state
from . import functional as TF
from .linear import ParallelLinear


class ParallelCrossEntropyLoss(nn.Module):
    """torch.nn.CrossEntropyLoss for logits sharded on their last dim.

    Parallel when the input is a column-parallel output (marked
    ``parallel_dim`` -1 or 1, as ParallelLinear(dim=1) marks it), plain
    F.cross_entropy otherwise (unmarked, or a row-parallel output marked 0); ``parallel=True/False`` forces either. The
    number of classes comes with the mark, so the default ``num_classes=None``
    costs one collective per forward; only an unmarked input with
    ``parallel=True`` and no ``num_classes`` pays one more (a shard-size
    exchange). See shardtorch.nn.functional.parallel_cross_entropy for the
    arguments (``z_loss`` adds z_loss * logsumexp^2 per row that is not ignored).
    The target may be class indices or, as for torch.nn.CrossEntropyLoss, class
    probabilities, sharded like the logits [*, local_classes] or whole
    [*, num_classes].
    """

    def __init__(self, weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 parallel: Optional[bool] = None, group: str = state.TENSOR_PARALLEL,
                 num_classes: Optional[int] = None, *, size_average: Optional[bool] = None,
                 reduce: Optional[bool] = None) -> None:
        super().__init__()
        if size_average is not None or reduce is not None:  # deprecated, as in torch.nn.CrossEntropyLoss
            reduction = TF._legacy_reduction(size_average, reduce)
        TF._reduction_code(reduction, "ParallelCrossEntropyLoss")
        for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"ParallelCrossEntropyLoss: {name} must be a float, got {value!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"ParallelCrossEntropyLoss: label_smoothing must be in [0, 1], "
                             f"got {label_smoothing!r}")
        if z_loss < 0.0:
            raise ValueError(f"ParallelCrossEntropyLoss: z_loss must be >= 0, got {z_loss!r}")
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss = label_smoothing, z_loss
        self.parallel, self.group, self.num_classes = parallel, group, num_classes

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return TF.parallel_cross_entropy(input, target, self.weight, self.ignore_index,
                                         self.reduction, self.label_smoothing, self.z_loss,
                                         self.parallel, self.group, self.num_classes)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"parallel={self.parallel}, group={self.group!r}")


class ParallelLinearCrossEntropyLoss(nn.Module):
    """The loss of a column-parallel classifier without its logits.

    ``loss_fn = ParallelLinearCrossEntropyLoss(head)`` with ``head`` a
    ParallelLinear(dim=1) computes ``ParallelCrossEntropyLoss()(head(x), target)``
    chunk by chunk over classes (``chunk_size``, default 4096): the extra
    memory does not grow with the number of classes. When gradients are needed
    it computes them in forward, by blocks of rows, and backward only scales
    them by the upstream gradient; where no block of at least 128 rows fits,
    the forward goes over the chunks a second time for them instead
    (docs/parallel_cross_entropy.md). ``head`` stays the owner of the parameters (optimisers, state
    dicts); this module only borrows them. A plain head (dim=None) falls back
    to head(x) followed by F.cross_entropy. The target may be class indices or
    class probabilities, sharded like the head's classes [*, local_classes] or
    whole [*, num_classes], as for ParallelCrossEntropyLoss.
    """

    def __init__(self, linear: ParallelLinear, weight: Optional[torch.Tensor] = None,
                 ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, chunk_size: int = TF.DEFAULT_CHUNK_SIZE) -> None:
        super().__init__()
        if not isinstance(linear, ParallelLinear) or linear.dim not in (None, 1, -1):
            raise ValueError("ParallelLinearCrossEntropyLoss: linear must be a column-parallel "
                             f"ParallelLinear (dim=1) or a plain one (dim=None), got {linear!r}")
        TF._reduction_code(reduction, "ParallelLinearCrossEntropyLoss")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"ParallelLinearCrossEntropyLoss: chunk_size must be a positive int, "
                             f"got {chunk_size!r}")
        # Not a submodule: the head's parameters belong to the model.
        self.__dict__["linear"] = linear
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss, self.chunk_size = label_smoothing, z_loss, chunk_size

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        head = self.linear
        if head.dim is None:
            return TF.parallel_cross_entropy(head(input), target, self.weight, self.ignore_index,
                                             self.reduction, self.label_smoothing, self.z_loss,
                                             parallel=False)
        # Through the head's own method: under fully_shard, its forward hooks run around it.
        return head.linear_cross_entropy(input, target, class_weight=self.weight, ignore_index=self.ignore_index,
                                         reduction=self.reduction, label_smoothing=self.label_smoothing,
                                         z_loss=self.z_loss, chunk_size=self.chunk_size)
