"""Parallel layers (``ts.nn``)."""
from . import functional, parallel
from .linear import ParallelLinear

__all__ = ["ParallelLinear", "functional", "parallel"]
