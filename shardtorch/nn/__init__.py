"""Parallel layers (``ts.nn``)."""
from . import functional, parallel
from .embedding import ParallelEmbedding
from .linear import ParallelLinear
from .loss import ParallelCrossEntropyLoss, ParallelLinearCrossEntropyLoss

__all__ = ["ParallelEmbedding", "ParallelLinear", "ParallelCrossEntropyLoss", "ParallelLinearCrossEntropyLoss",
           "functional", "parallel"]
