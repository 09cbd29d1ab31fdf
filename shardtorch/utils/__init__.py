from . import data
from .parallel_dim import get_parallel_dim, get_parallel_full_size, register_parallel_dim

__all__ = ["data", "get_parallel_dim", "get_parallel_full_size", "register_parallel_dim"]
