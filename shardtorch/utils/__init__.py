from . import data
from .parallel_dim import get_parallel_dim, register_parallel_dim

__all__ = ["data", "get_parallel_dim", "register_parallel_dim"]
