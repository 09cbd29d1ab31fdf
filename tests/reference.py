"""Helpers for comparing shardtorch against unsharded torch."""
import torch

import shardtorch as ts
from shardtorch import _C


def shard_range(total: int, group: str = "tp"):
    size, rank = ts.distributed.get_group_size(group), ts.distributed.get_group_rank(group)
    offset = _C.shard_offset(total, size, rank)
    return offset, offset + _C.shard_size(total, size, rank)


def shard_of(full: torch.Tensor, dim: int, group: str = "tp") -> torch.Tensor:
    lo, hi = shard_range(full.shape[dim], group)
    return full.narrow(dim, lo, hi - lo)


def tolerance(dtype):
    """(rtol, atol) for comparing against a float64 reference."""
    return {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5),
            torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}[dtype]


def assert_close(actual, expected, dtype=None, what=""):
    rtol, atol = tolerance(dtype or actual.dtype)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
