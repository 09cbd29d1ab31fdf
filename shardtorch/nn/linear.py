"""ParallelLinear: torch.nn.Linear with its weight split over a tensor-parallel
group, TorchShard's API over the op torch.ops.shard.parallel_linear."""
from typing import Optional

import torch
from torch import nn

from .. import _C
from ..distributed import state
from ..utils.fsdp_detection import is_dtensor
from ..utils.parallel_dim import is_sharded_on_last_dim, register_parallel_dim, set_attribute
from ..utils.shard_facts import register_shard
from ..utils.shards import shard_range
from .convert import replace_modules
from .parallel.plain_ddp import check_active_ddp, register_ddp_parameters_to_ignore
from .init import draw_on_cpu_, init_linear_shard_

_DIMS = (None, 0, 1, -1)


class ParallelLinear(nn.Module):
    """y = x W^T + b with W split over the tensor-parallel group.

    Args:
        in_features, out_features, bias, device, dtype: as torch.nn.Linear.
        dim: a dimension of the [in, out] view of the weight, as in TorchShard.
            None: a plain linear layer. 1 or -1: column-parallel, out_features
            are split and the output is sharded on its last dim (marked with
            ``parallel_dim = -1`` and its full size, out_features). 0:
            row-parallel, in_features are split; the input may be sharded
            (from a column-parallel layer) or whole (the layer takes its
            slice); the output is whole; the bias is whole and added once.
        group: name of the shardtorch group to split over (default "tp").

    Shards need not be even: the first ``n % size`` ranks hold one more. A new
    layer holds exactly the slice of the weights torch.nn.Linear(in, out) draws
    under the same torch.manual_seed (see shardtorch.nn.init).
    """

    __constants__ = ["in_features", "out_features", "dim", "group"]
    in_features: int
    out_features: int
    dim: Optional[int]
    group: str

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dim: Optional[int] = None, device=None, dtype=None,
                 group: str = state.TENSOR_PARALLEL, _initialize: bool = True) -> None:
        super().__init__()
        if dim not in _DIMS or isinstance(dim, bool):
            raise ValueError(f"ParallelLinear: dim must be None, 0, 1 or -1, got {dim!r}")
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ParallelLinear: {name} must be a non-negative int, got {value!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"ParallelLinear: dtype must be a floating point dtype, got {dtype}")
        self.in_features, self.out_features, self.dim, self.group = in_features, out_features, dim, group
        rank, size = (0, 1) if dim is None else (state.get_group_rank(group), state.get_group_size(group))
        self.group_rank, self.group_size = rank, size
        # Rank 0's shard of the input features is all of them (in_features <= 1
        # over several ranks): the op would read a whole input as that shard.
        self._whole_input_is_ambiguous = size > 1 and _C.shard_size(in_features, size, 0) == in_features
        out_range, in_range = (0, out_features), (0, in_features)
        if dim in (1, -1):
            out_range = shard_range(out_features, size, rank)
        elif dim == 0:
            in_range = shard_range(in_features, size, rank)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_range[1] - out_range[0], in_range[1] - in_range[0],
                                               **factory))
        bias_size = out_range[1] - out_range[0]
        self.bias = nn.Parameter(torch.empty(bias_size, **factory)) if bias else None
        # The shard facts live on the layer (they survive wrappers); the
        # tensors also carry TorchShard's mark (the layer's dim, order_type 0:
        # the weight stores the [in, out] view reversed) for its readers.
        set_attribute(self.weight, dim, order_type=0)
        if self.bias is not None:
            set_attribute(self.bias, dim, order_type=0)
        if dim in (1, -1):
            register_shard(self, "weight", 0, out_features, group)
            if self.bias is not None:
                register_shard(self, "bias", 0, out_features, group)
        elif dim == 0:
            register_shard(self, "weight", 1, in_features, group)
        self._out_range, self._in_range = out_range, in_range
        if _initialize:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draws this rank's slice of torch.nn.Linear's initialisation."""
        draw_on_cpu_(lambda weight, bias: init_linear_shard_(weight, bias, self.in_features, self.out_features,
                                                             self._out_range, self._in_range),
                     self.weight, self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        marked_sharded = False
        if not torch.jit.is_scripting():
            marked_sharded = is_sharded_on_last_dim(input)
            self._check_input(input, marked_sharded)
        if self.dim == 0 and self._whole_input_is_ambiguous and input.shape[-1] == self.in_features \
                and not marked_sharded:
            # A whole input that the op would read as rank 0's shard: every
            # rank slices it explicitly, so that all of them run the same
            # collectives in forward and backward.
            input = torch.ops.shard.scatter(input, -1, self.group)
        output = torch.ops.shard.parallel_linear(input, self.weight, self.bias, self.dim, self.group)
        if not torch.jit.is_scripting():
            if self.dim == 1 or self.dim == -1:
                # The full size lets the parallel loss skip exchanging shard sizes.
                register_parallel_dim(output, -1, self.out_features)
        return output

    @torch.jit.unused
    def linear_cross_entropy(self, input: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
        """The parallel cross-entropy of this column-parallel layer's logits
        without them (ts.nn.functional.parallel_linear_cross_entropy; ``options``
        are its class_weight, ignore_index, ...): what ParallelLinearCrossEntropyLoss
        calls. A method of the layer, so that wrappers acting around a layer's
        forward methods (fully_shard's register_fsdp_forward_method) gather its
        parameters for it and reduce their gradients as for forward."""
        from . import functional as TF
        if is_dtensor(self.weight):
            raise RuntimeError(
                "ParallelLinear.linear_cross_entropy: the weight is a DTensor (fully_shard's sharded form), so "
                "its parameters were not gathered: fully_shard gathers them only around the forward methods it "
                "knows. Wrap the model with ts.nn.parallel.fully_shard, or call torch.distributed.fsdp."
                "register_fsdp_forward_method(head, 'linear_cross_entropy') after fully_shard(head)")
        return TF.parallel_linear_cross_entropy(input, self.weight, self.bias, target, group=self.group,
                                                num_classes=self.out_features, **options)

    @torch.jit.unused
    def _check_input(self, input: torch.Tensor, marked_sharded: bool) -> None:
        check_active_ddp()
        if self.dim != 0 or input.dim() < 1:
            return  # the op checks the rest
        width, local = input.shape[-1], self.weight.shape[1]
        if marked_sharded and width != local:
            raise ValueError(
                f"ParallelLinear(dim=0): input is marked as sharded on its last dim but has "
                f"{width} features where this rank's shard of in_features="
                f"{self.in_features} is {local}")
        # The op alone, knowing only this rank's shard, would take a width whose
        # slice happens to fit this rank as a whole input while another rank
        # refuses it: the layer knows the whole in_features, so a width that is
        # neither is refused on every rank alike, before any collective.
        if width != self.in_features and width != local:
            raise RuntimeError(
                f"ParallelLinear(dim=0): input.size(-1) must be in_features = {self.in_features} (a whole "
                f"input) or this rank's shard of it ({local} = weight.size(1) on rank {self.group_rank} of "
                f"{self.group_size}), got input of shape {tuple(input.shape)}")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dim={self.dim}, group={self.group!r}, "
                f"shard={tuple(self.weight.shape)}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, dim: Optional[int],
                    group: str = state.TENSOR_PARALLEL) -> "ParallelLinear":
        """A ParallelLinear holding this rank's slice of ``linear``'s weights."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, dim=dim,
                    device=linear.weight.device, dtype=linear.weight.dtype, group=group,
                    _initialize=False)
        with torch.no_grad():
            (o0, o1), (i0, i1) = layer._out_range, layer._in_range
            layer.weight.copy_(linear.weight[o0:o1, i0:i1])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias if dim == 0 else linear.bias[o0:o1])
        layer.weight.requires_grad_(linear.weight.requires_grad)
        if layer.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        layer.train(linear.training)
        return layer

    @classmethod
    def convert_parallel_linear(cls, module: nn.Module, dim: Optional[int] = None,
                                group: str = state.TENSOR_PARALLEL) -> nn.Module:
        """Replaces every torch.nn.Linear in ``module`` (nested ones too, and
        ``module`` itself) by a ParallelLinear keeping its trained weights,
        and, as TorchShard, tells a torch DistributedDataParallel wrapped
        around the result to leave the shards alone
        (``ts.register_ddp_parameters_to_ignore``)."""
        converted = replace_modules(module, nn.Linear, lambda linear: cls.from_linear(linear, dim, group),
                                    ParallelLinear)
        register_ddp_parameters_to_ignore(converted)
        return converted
