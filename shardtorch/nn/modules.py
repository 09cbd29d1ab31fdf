"""``ts.nn.modules``: the module classes, where TorchShard kept them."""
from .embedding import ParallelEmbedding
from .linear import ParallelLinear
from .loss import ParallelCrossEntropyLoss, ParallelLinearCrossEntropyLoss
from .register_parallel_dim import RegisterParallelDim

__all__ = ["ParallelEmbedding", "ParallelLinear", "ParallelCrossEntropyLoss", "ParallelLinearCrossEntropyLoss",
           "RegisterParallelDim"]
