"""Parallel layers (``ts.nn``)."""
from . import functional, init, parallel
from .embedding import ParallelEmbedding
from .linear import ParallelLinear
from .loss import ParallelCrossEntropyLoss, ParallelLinearCrossEntropyLoss
from .margin import MARGIN_PRESETS, ParallelMarginLoss
from .register_parallel_dim import RegisterParallelDim
from . import modules  # noqa: E402  (TorchShard's ts.nn.modules)

__all__ = ["ParallelEmbedding", "ParallelLinear", "ParallelCrossEntropyLoss", "ParallelLinearCrossEntropyLoss",
           "ParallelMarginLoss", "MARGIN_PRESETS", "RegisterParallelDim", "functional", "init", "modules",
           "parallel"]
