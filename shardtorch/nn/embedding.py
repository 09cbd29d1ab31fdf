"""ParallelEmbedding: torch.nn.Embedding with its table split over a
tensor-parallel group, over the op torch.ops.shard.parallel_embedding."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import state
from ..utils.parallel_dim import set_attribute
from ..utils.shard_facts import register_shard
from ..utils.shards import shard_range
from .convert import replace_modules
from .parallel.plain_ddp import check_active_ddp, register_ddp_parameters_to_ignore
from .embedding_init import init_embedding_shard_
from .init import draw_on_cpu_


class ParallelEmbedding(nn.Module):
    """A lookup table split over the tensor-parallel group.

    Args:
        num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
        scale_grad_by_freq, sparse, device, dtype: as torch.nn.Embedding, and
            honoured exactly as it does.
        dim: as TorchShard, a dimension of the [num_embeddings,
            embedding_dim] table. None (default, as TorchShard): not split,
            torch.nn.Embedding. 0: vocabulary-parallel, each rank holds a
            slice of the rows; indices of other ranks' rows look up zeros and
            the group sums its outputs. 1 (or -1): embedding-dim-parallel,
            each rank holds a slice of the columns; the output is gathered on
            its last dim. Either way every rank returns the whole
            [*, embedding_dim] output, as torch.nn.Embedding does (so it feeds
            any layer, sharded or not).
        group: name of the shardtorch group to split over (default "tp").

    A new layer holds exactly the slice of the table torch.nn.Embedding draws
    under the same torch.manual_seed on the CPU (see shardtorch.nn.embedding_init).
    With ``max_norm`` the referenced rows are renormalised in place before the
    lookup; for dim=1 a row's norm spans all shards and is combined over the group.
    """

    __constants__ = ["num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse", "dim", "group"]

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, dim: Optional[int] = None,
                 device=None, dtype=None, group: str = state.TENSOR_PARALLEL,
                 _initialize: bool = True) -> None:
        super().__init__()
        if dim not in (None, 0, 1, -1) or isinstance(dim, bool):
            raise ValueError(f"ParallelEmbedding: dim must be 0 (vocabulary-parallel), 1 or -1 "
                             f"(embedding-dim-parallel) or None (not split), got {dim!r}")
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ParallelEmbedding: {name} must be a non-negative int, got {value!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"ParallelEmbedding: padding_idx must be within num_embeddings = "
                                 f"{num_embeddings} (in [{-num_embeddings}, {num_embeddings})), "
                                 f"got {padding_idx}")
            padding_idx = padding_idx % num_embeddings  # as torch.nn.Embedding normalises it
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse, self.dim, self.group = scale_grad_by_freq, sparse, dim, group
        # The table dimension that is split (-1 is 1); -1: not split (an int,
        # so that TorchScript sees one type whatever dim is).
        self._split_dim = -1 if dim is None else dim % 2
        size, rank = (1, 0) if dim is None else (state.get_group_size(group), state.get_group_rank(group))
        self.group_rank, self.group_size = rank, size
        self._row_range, self._col_range = (0, num_embeddings), (0, embedding_dim)
        if dim is not None:
            split = shard_range(num_embeddings if self._split_dim == 0 else embedding_dim, size, rank)
            if self._split_dim == 0:
                self._row_range = split
            else:
                self._col_range = split
        shape = (self._row_range[1] - self._row_range[0], self._col_range[1] - self._col_range[0])
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        # The shard facts live on the layer (they survive wrappers); the table
        # also carries TorchShard's mark (the layer's dim, order_type 1: the
        # table is in the layer's own order) for its readers.
        set_attribute(self.weight, dim, order_type=1)
        if dim is not None:
            register_shard(self, "weight", self._split_dim, self._full_size, group)
        if _initialize:
            self.reset_parameters()

    @property
    def _full_size(self) -> int:
        return self.num_embeddings if self._split_dim == 0 else self.embedding_dim

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draws this rank's slice of torch.nn.Embedding's initialisation."""
        draw_on_cpu_(lambda weight: init_embedding_shard_(weight, self.num_embeddings, self.embedding_dim,
                                                          self._row_range, self._col_range, self.padding_idx),
                     self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting() and not torch.compiler.is_compiling():
            self._check_indices(input)
        if self._split_dim < 0:
            return F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.sparse)
        if self.max_norm is not None:
            with torch.no_grad():
                torch.ops.shard.parallel_embedding_renorm_(self.weight, input, self.max_norm,
                                                           self.norm_type, self._split_dim, self._full_size,
                                                           self.group)
        return torch.ops.shard.parallel_embedding(input, self.weight, self.padding_idx, self._split_dim,
                                                  self._full_size, self.scale_grad_by_freq,
                                                  self.sparse, self.group)

    @torch.jit.unused
    def _check_indices(self, input: torch.Tensor) -> None:
        check_active_ddp()
        # A vocabulary-parallel lookup would silently return zeros for an index
        # past the table: check it as torch.nn.Embedding does. Only for CPU
        # inputs, where the check costs no device synchronisation.
        if input.device.type == "cpu" and input.numel() > 0:
            low, high = int(input.min()), int(input.max())
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(f"ParallelEmbedding: indices must be in [0, num_embeddings = "
                                 f"{self.num_embeddings}), got values in [{low}, {high}]")

    def extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}, dim={self.dim}, group={self.group!r}"
        for name, default in (("padding_idx", None), ("max_norm", None), ("norm_type", 2.0),
                              ("scale_grad_by_freq", False), ("sparse", False)):
            if getattr(self, name) != default:
                text += f", {name}={getattr(self, name)}"
        return text + f", shard={tuple(self.weight.shape)}"

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, dim: Optional[int],
                       group: str = state.TENSOR_PARALLEL) -> "ParallelEmbedding":
        """A ParallelEmbedding holding this rank's slice of ``embedding``'s
        table, with every option of ``embedding`` (and its requires_grad and
        training mode)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                    embedding.max_norm, embedding.norm_type, embedding.scale_grad_by_freq,
                    embedding.sparse, dim=dim, device=embedding.weight.device,
                    dtype=embedding.weight.dtype, group=group, _initialize=False)
        with torch.no_grad():
            (r0, r1), (c0, c1) = layer._row_range, layer._col_range
            layer.weight.copy_(embedding.weight[r0:r1, c0:c1])
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        layer.train(embedding.training)
        return layer

    @classmethod
    def convert_parallel_embedding(cls, module: nn.Module, dim: Optional[int] = None,
                                   group: str = state.TENSOR_PARALLEL) -> nn.Module:
        """Replaces every torch.nn.Embedding in ``module`` (nested ones too, and
        ``module`` itself) by a ParallelEmbedding keeping its trained weights
        and options, and, as TorchShard, tells a torch DistributedDataParallel
        wrapped around the result to leave the shards alone
        (``ts.register_ddp_parameters_to_ignore``)."""
        converted = replace_modules(module, nn.Embedding,
                                    lambda embedding: cls.from_embedding(embedding, dim, group), ParallelEmbedding)
        register_ddp_parameters_to_ignore(converted)
        return converted
