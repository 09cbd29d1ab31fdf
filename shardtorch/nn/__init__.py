"""Parallel layers (``ts.nn``)."""
from . import functional
from .linear import ParallelLinear

__all__ = ["ParallelLinear", "functional"]
