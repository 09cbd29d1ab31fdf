"""Parallel layers (``ts.nn``)."""
from . import functional, parallel
from .linear import ParallelLinear
from .loss import ParallelCrossEntropyLoss, ParallelLinearCrossEntropyLoss

__all__ = ["ParallelLinear", "ParallelCrossEntropyLoss", "ParallelLinearCrossEntropyLoss",
           "functional", "parallel"]
