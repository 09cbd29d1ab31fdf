"""Parallel layers (``ts.nn``)."""
from . import functional
from .embedding import ParallelEmbedding
from .linear import ParallelLinear

__all__ = ["ParallelEmbedding", "ParallelLinear", "functional"]
