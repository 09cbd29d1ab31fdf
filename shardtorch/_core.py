"""Loads the C++ core: importing shardtorch._C loads libshardtorch.so, which
registers the torch.ops.shard.* operators."""
from . import _C  # noqa: F401  (side effect: registers the ops)

cuda_built = _C.cuda_built
