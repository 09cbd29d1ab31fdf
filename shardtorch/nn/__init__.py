"""Parallel layers (``ts.nn``)."""
from . import functional, parallel
from .embedding import ParallelEmbedding
from .linear import ParallelLinear
from .loss import ParallelCrossEntropyLoss, ParallelLinearCrossEntropyLoss
from .margin import MARGIN_PRESETS, ParallelMarginLoss

__all__ = ["ParallelEmbedding", "ParallelLinear", "ParallelCrossEntropyLoss", "ParallelLinearCrossEntropyLoss",
           "ParallelMarginLoss", "MARGIN_PRESETS",
           "functional", "parallel"]
