from .parallel_dim import get_parallel_dim, register_parallel_dim

__all__ = ["get_parallel_dim", "register_parallel_dim"]
