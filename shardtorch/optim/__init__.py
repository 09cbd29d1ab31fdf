"""Optimizers that honour row-sparse gradients (``ts.optim``): rows a gradient
does not hold keep their values and their optimizer state, as a sampled
ParallelMarginLoss needs (docs/margin_loss.md)."""
from .row_sparse import RowSparseAdam, RowSparseSGD

__all__ = ["RowSparseAdam", "RowSparseSGD"]
