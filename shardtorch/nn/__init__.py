"""Parallel layers (``ts.nn``)."""
from . import functional, init, parallel
from .embedding import ParallelEmbedding
from .linear import ParallelLinear
from .loss import ParallelCrossEntropyLoss, ParallelLinearCrossEntropyLoss
from .margin import MARGIN_PRESETS, ParallelMarginLoss
from .register_parallel_dim import RegisterParallelDim
from . import modules  # noqa: E402  (TorchShard's ts.nn.modules)
# ts.nn.parallelize is the function; its package is shardtorch.nn.whole_model (distinct names, so neither hides the other).
from .whole_model import (STYLES as PARALLELIZE_STYLES, auto_plan, causal_lm_loss, from_config,  # noqa: E402
                          from_pretrained, lora_config, parallelize, save_adapter)

__all__ = ["ParallelEmbedding", "ParallelLinear", "ParallelCrossEntropyLoss", "ParallelLinearCrossEntropyLoss",
           "ParallelMarginLoss", "MARGIN_PRESETS", "RegisterParallelDim", "functional", "init", "modules",
           "parallel", "parallelize", "from_pretrained", "from_config", "auto_plan", "causal_lm_loss", "PARALLELIZE_STYLES",
           "lora_config", "save_adapter"]
