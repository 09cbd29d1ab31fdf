"""The projections parallelize puts in place of a model's own Linear or
Conv1D layers: column-parallel by whole heads (fused q/k/v parts included),
row-parallel, and a replicated key/value projection for grouped-query
attention with fewer key/value heads than ranks.

They keep the replaced layer's parameter names and orientation (a Conv1D's
weight stays [in, out]), so that the model's state-dict keys do not change and
a collected checkpoint is the unsharded model's own.
"""
import collections
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed import mappings
from ...utils.shard_facts import register_shard, split_pieces


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer with its weight stored [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def projection_sizes(module: nn.Module) -> Tuple[int, int]:
    """(in_features, out_features) of a Linear or a Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return module.nx, module.nf
    raise TypeError(f"parallelize: expected torch.nn.Linear or Conv1D, got {type(module).__name__}")


def is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


class SharedInputCopy:
    """One ``copy`` (identity forward, all-reduce of the gradient backward) for
    all the projections of a block that read the same input (q, k and v; gate
    and up): the block's backward then all-reduces that input's gradient once
    (Megatron's count), not once per projection. The copy is kept until every
    member has read it, then dropped, so it pins no activation across steps."""

    def __init__(self, group: str, members: int) -> None:
        self.group, self.members = group, members
        self._source: Optional[torch.Tensor] = None
        self._copied: Optional[torch.Tensor] = None
        self._reads = 0

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        if self._source is not None and self._source is input:
            copied = self._copied
            self._reads += 1
        else:
            copied = mappings.copy(input, self.group)
            self._source, self._copied, self._reads = input, copied, 1
        if self._reads >= self.members:
            self._source = self._copied = None
        return copied


class SequenceGathered:
    """The input mapping of column-parallel projections under sequence
    parallelism: the module owning them all-gathers its input along the
    sequence (``gather_sequence_before``), whose backward reduce-scatters
    the gradient; the projections then read it as it is."""

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return input


def block_input(group: str, members: int, sequence_parallel: bool):
    """The input mapping shared by ``members`` column-parallel projections of one block."""
    return SequenceGathered() if sequence_parallel else SharedInputCopy(group, members)


def _first_tensor_argument(args, kwargs):
    if args:
        return "args", 0
    for key in ("hidden_states", "x", "input"):
        if torch.is_tensor(kwargs.get(key)):
            return "kwargs", key
    raise ValueError("parallelize(sequence_parallel=True): cannot find the hidden states among the module's "
                     f"arguments (positional first, or hidden_states=/x=/input=), got keywords {sorted(kwargs)}")


def _replace_argument(args, kwargs, function):
    where, key = _first_tensor_argument(args, kwargs)
    if where == "args":
        args = (function(args[0]),) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, **{key: function(kwargs[key])})
    return args, kwargs


def _check_sequence(tensor: torch.Tensor, dim: int, group: str) -> None:
    from ...distributed import state
    size = state.get_group_size(group)
    # Three dimensions: a block reading [batch, height, width, features] (Swin's windows) would split rows
    # of its image, which its window partition cannot read.
    if tensor.dim() != 3 or tensor.shape[dim] < size:
        raise ValueError(f"parallelize(sequence_parallel=True): the hidden states must be [batch, sequence, "
                         f"features] with at least {size} positions (one per rank), got shape {tuple(tensor.shape)}")


def gather_sequence_before(module: nn.Module, group: str, dim: int = 1):
    """Makes ``module`` see its hidden states whole along the sequence: all-gather forward, reduce-scatter backward."""
    def hook(_, args, kwargs):
        return _replace_argument(args, kwargs, lambda x: mappings.all_gather(x, dim, group))
    return module.register_forward_pre_hook(hook, with_kwargs=True)


def scatter_sequence_before(module: nn.Module, group: str, dim: int = 1):
    """The first block of a sequence-parallel region: each rank keeps its slice of the sequence."""
    def scatter(x):
        _check_sequence(x, dim, group)
        return mappings.scatter(x, dim, group)

    def hook(_, args, kwargs):
        return _replace_argument(args, kwargs, scatter)
    return module.register_forward_pre_hook(hook, with_kwargs=True)


def gather_sequence_after(module: nn.Module, group: str, dim: int = 1):
    """The last block of a sequence-parallel region: its output whole again, for the replicated layers after it
    (backward keeps this rank's slice of their gradient, which every rank computes whole)."""
    def hook(_, args, output):
        if torch.is_tensor(output):
            return mappings.gather_replicated(output, dim, group)
        if isinstance(output, tuple) and output and torch.is_tensor(output[0]):
            return (mappings.gather_replicated(output[0], dim, group),) + tuple(output[1:])
        raise ValueError(f"parallelize(sequence_parallel=True): {type(module).__name__} returned "
                         f"{type(output).__name__}, not a tensor or a tuple starting with one")
    return module.register_forward_hook(hook)


def _rows(weight: torch.Tensor, dim: int, pieces: Sequence[Tuple[int, int]]) -> torch.Tensor:
    parts = [weight.narrow(dim, offset, length) for offset, length in pieces]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).detach().clone()


def _apply(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool):
    if transposed:  # Conv1D's layout: weight [in, out]
        output = input @ weight
    else:
        output = F.linear(input, weight)
    return output if bias is None else output + bias


class ColumnProjection(nn.Module):
    """A Linear or Conv1D whose output features are split over the group by
    whole heads: the out dimension is ``blocks`` fused parts (3 for a fused
    q/k/v projection) of heads of ``unit`` features, and this rank holds, from
    every part, the heads ``shard_range(heads, size, rank)`` gives it. (A
    ``unit`` of several heads keeps groups of them together: grouped-query
    attention's query heads that share a key/value head.) ``parts`` instead:
    fused parts of their own lengths and units (shardtorch.utils.shard_facts).
    The input is whole; its gradient is all-reduced once per ``shared`` copy.

    ``gathered`` ({part index: unit indices or None}): parts this rank needs
    whole although it holds at most a slice of them (the key/value part of a
    fused projection with fewer key/value heads than ranks). Each forward
    sums the ranks' slices of such a part over the group (every rank then
    holds it whole, and its gradient is summed back over the group in
    backward, so the rank that holds a row gets every rank's share), and uses
    the units listed (all of them for None), in that order, where the part's
    output lies."""

    def __init__(self, source: nn.Module, group: str, group_size: int, group_rank: int, shared,
                 blocks: int = 1, unit: int = 1, parts: Optional[Tuple[Tuple[int, int], ...]] = None,
                 gathered: Optional[Dict[int, Optional[List[int]]]] = None) -> None:
        super().__init__()
        self.transposed = is_conv1d(source)
        in_features, out_features = projection_sizes(source)
        self.full_in_features, self.full_out_features = in_features, out_features
        self.group, self.blocks, self.unit, self.parts = group, blocks, unit, parts
        self.pieces = split_pieces(out_features, group_size, group_rank, blocks, unit, parts)
        out_dim = 1 if self.transposed else 0
        self.weight = nn.Parameter(_rows(source.weight, out_dim, self.pieces),
                                   requires_grad=source.weight.requires_grad)
        self.bias = None if source.bias is None else nn.Parameter(_rows(source.bias, 0, self.pieces),
                                                                  requires_grad=source.bias.requires_grad)
        self.in_features = in_features
        self._segments = _output_segments(out_features, self.pieces, parts, gathered or {})
        self.out_features = sum(_segment_length(segment) for segment in self._segments)
        register_shard(self, "weight", out_dim, out_features, group, blocks, unit, parts)
        if self.bias is not None:
            register_shard(self, "bias", 0, out_features, group, blocks, unit, parts)
        self._shared = shared
        self.train(source.training)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.project(self.read_input(input))

    def read_input(self, input: torch.Tensor) -> torch.Tensor:
        """The input as the projection reads it (through the block's shared ``copy``)."""
        return self._shared(input)

    def project(self, input: torch.Tensor) -> torch.Tensor:
        """The output from an input already read by ``read_input``."""
        out_dim = 1 if self.transposed else 0
        weight = self.output_rows(self.weight, out_dim)
        bias = None if self.bias is None else self.output_rows(self.bias, 0)
        return _apply(input, weight, bias, self.transposed)

    def output_rows(self, held: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's rows of a tensor split as the output features (the weight, the bias, a LoRA B) in
        the order of the output: as held, or with the parts needed whole summed over the group."""
        if len(self._segments) == 1 and self._segments[0][0] == "held":
            return held
        return self._assemble(held, dim)

    def _assemble(self, held: torch.Tensor, dim: int) -> torch.Tensor:
        rows = []
        for segment in self._segments:
            if segment[0] == "held":
                rows.append(held.narrow(dim, segment[1], segment[2]))
                continue
            _, start, length, before, after, part_unit, units = segment
            mine = held.narrow(dim, start, length)
            padding = [0, 0] * (held.dim() - 1 - dim) + [before, after]
            # Zeros where other ranks hold the part: the sum over the group is the whole part.
            whole = mappings.copy(mappings.reduce(F.pad(mine, padding), self.group), self.group)
            if units is None:
                rows.append(whole)
            else:
                rows += [whole.narrow(dim, u * part_unit, part_unit) for u in units]
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim)

    def extra_repr(self) -> str:
        kind = "Conv1D" if self.transposed else "Linear"
        split = f"parts={self.parts}" if self.parts is not None else f"blocks={self.blocks}, unit={self.unit}"
        return (f"{kind} {self.full_in_features}->{self.full_out_features}, column-parallel, {split}, "
                f"shard={tuple(self.weight.shape)}, group={self.group!r}")


def _segment_length(segment) -> int:
    if segment[0] == "held":
        return segment[2]
    _, _, length, before, after, part_unit, units = segment
    return length + before + after if units is None else part_unit * len(units)


def _output_segments(out_features: int, pieces, parts, gathered):
    """The output of a column projection as segments of rows, in order: ("held", start, length) rows of
    this rank's shard, or ("whole", start, length, before, after, unit, units) a part summed whole over the
    group from this rank's ``length`` rows at ``start`` (``before`` and ``after`` rows of it held elsewhere)."""
    if not gathered:
        return [("held", 0, sum(length for _, length in pieces))]
    segments, part_offset, local = [], 0, 0
    for index, (part_length, part_unit) in enumerate(parts):
        mine = [(offset, length) for offset, length in pieces
                if length and part_offset <= offset < part_offset + part_length]
        offset, length = mine[0] if mine else (part_offset, 0)
        if index in gathered:
            segments.append(("whole", local, length, offset - part_offset, part_offset + part_length - offset - length,
                             part_unit, gathered[index]))
        elif length:
            segments.append(("held", local, length))
        local += length
        part_offset += part_length
    return segments


class RowProjection(nn.Module):
    """A Linear or Conv1D whose input features are split over the group (by
    whole heads of ``unit`` features, or ``parts`` as ColumnProjection's):
    it reads the sharded output of a column-parallel projection, sums the
    partial products over the group (one all-reduce forward, none backward)
    and adds the whole bias once. ``sequence_dim`` (sequence parallelism):
    reduce-scatter along it instead, each rank keeping its part of the sequence."""

    def __init__(self, source: nn.Module, group: str, group_size: int, group_rank: int, unit: int = 1,
                 sequence_dim: Optional[int] = None, parts: Optional[Tuple[Tuple[int, int], ...]] = None) -> None:
        super().__init__()
        self.transposed = is_conv1d(source)
        in_features, out_features = projection_sizes(source)
        self.full_in_features, self.full_out_features = in_features, out_features
        self.group, self.unit, self.sequence_dim, self.parts = group, unit, sequence_dim, parts
        self.pieces = split_pieces(in_features, group_size, group_rank, 1, unit, parts)
        in_dim = 0 if self.transposed else 1
        self.weight = nn.Parameter(_rows(source.weight, in_dim, self.pieces),
                                   requires_grad=source.weight.requires_grad)
        self.bias = None if source.bias is None else nn.Parameter(source.bias.detach().clone(),
                                                                  requires_grad=source.bias.requires_grad)
        self.in_features = sum(length for _, length in self.pieces)
        self.out_features = out_features
        register_shard(self, "weight", in_dim, in_features, group, 1, unit, parts)
        self.train(source.training)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(input))

    def partial(self, input: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output: its input features' product, not yet summed over the group."""
        if input.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: input must be this rank's shard of {self.full_in_features} "
                             f"features ({self.in_features} here), got last dim {input.shape[-1]}")
        return _apply(input, self.weight, None, self.transposed)

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """The output from the ranks' shares: one all-reduce (or reduce-scatter), then the bias once."""
        if self.sequence_dim is None:
            output = mappings.reduce(partial, self.group)
        else:
            output = mappings.reduce_scatter(partial, self.sequence_dim, self.group)
        return output if self.bias is None else output + self.bias

    def extra_repr(self) -> str:
        kind = "Conv1D" if self.transposed else "Linear"
        return (f"{kind} {self.full_in_features}->{self.full_out_features}, row-parallel, unit={self.unit}, "
                f"shard={tuple(self.weight.shape)}, group={self.group!r}")


class ReplicatedKeyValue(nn.Module):
    """The key or value projection of grouped-query attention with fewer
    key/value heads than ranks: the weight stays whole on every rank
    (replicated), and the projection computes, for each of this rank's query
    heads, its key/value head (repeated as the attention would repeat it), so
    the attention runs with one key/value head per query head. A rank's
    gradient covers only its query heads' share, so the weight passes through
    ``copy``: its gradient is summed over the group in backward (exact).
    The heads' rows are taken by slicing, not by an index tensor, so that a
    model built on the meta device needs no buffer filled afterwards."""

    def __init__(self, source: nn.Linear, group: str, head_dim: int, kv_heads: List[int],
                 shared) -> None:
        super().__init__()
        self.group, self.head_dim = group, head_dim
        self.weight = source.weight
        self.bias = source.bias
        self.kv_heads = list(kv_heads)
        self.in_features, self.out_features = source.in_features, len(self.kv_heads) * head_dim
        self._shared = shared
        self.train(source.training)

    def _heads(self, tensor: torch.Tensor) -> torch.Tensor:
        whole = mappings.copy(tensor, self.group)
        return torch.cat([whole.narrow(0, h * self.head_dim, self.head_dim) for h in self.kv_heads], 0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.project(self.read_input(input))

    def read_input(self, input: torch.Tensor) -> torch.Tensor:
        return self._shared(input)

    def project(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self._heads(self.bias)
        return F.linear(input, self._heads(self.weight), bias)

    def output_rows(self, whole: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The rows of this rank's key/value heads (each as often as a local query head reads it) of a
        whole tensor laid out as the output features, its gradient summed over the group."""
        return self._heads(whole)

    def extra_repr(self) -> str:
        return f"replicated {tuple(self.weight.shape)}, key/value heads per local query head {self.kv_heads}"


def draw_dropout_from_model_parallel_stream(module: nn.Module) -> None:
    """Makes ``module``'s forward, while training, draw its random numbers from
    shardtorch.random's model-parallel stream (different per rank of the
    group) when that stream is seeded (``ts.random.model_parallel_seed``):
    dropout on sharded activations (this rank's heads, its part of the
    sequence) then draws masks independent across ranks, and the default
    stream, which replicated activations draw from, does not advance inside.
    Hooks, not a replaced forward, so that copies of the model stay right.
    A region that draws no random numbers (read once, here: see
    ``may_draw_random_numbers``) does not fork the stream: nothing would
    change, and under torch.compile the fork's generator state calls break
    the graph."""
    module.__dict__[_DRAWS_ATTR] = may_draw_random_numbers(module)
    module.register_forward_pre_hook(_enter_model_parallel_stream)
    module.register_forward_hook(_leave_model_parallel_stream, always_call=True)


_FORK_ATTR = "_shardtorch_dropout_fork"
_DRAWS_ATTR = "_shardtorch_draws_random_numbers"


def _positive_drop(owner) -> bool:
    return any("drop" in name and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
               for name, value in vars(owner).items())


def may_draw_random_numbers(module: nn.Module) -> bool:
    """Whether ``module``'s forward may draw random numbers while training: a dropout submodule with p > 0,
    or a number above 0 under a name containing "drop" in a submodule or its config (the functional
    dropout of Llama's ``attention_dropout``, GPT-2's ``attn_pdrop``). Conservative: any such number counts."""
    for sub in module.modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            return True
        config = getattr(sub, "config", None)
        if _positive_drop(sub) or (config is not None and hasattr(config, "__dict__") and _positive_drop(config)):
            return True
    return False


_ENTRIES_ATTR = "_shardtorch_stream_at_entry"
_ENTRIES_KEPT = 8  # forwards whose recompute may still come, per module (gradient accumulation)


def _enter_model_parallel_stream(module, args):
    """Enters the model-parallel stream. A forward run again by activation checkpointing (in backward,
    torch.utils.checkpoint restoring the default generators' states) must draw the masks its first run
    drew: each forward keeps the stream's state at its entry, by the default
    generators' state there, and a recompute that finds its own resumes from it, leaving the stream
    where it was afterwards."""
    from ... import random as ts_random
    tracker = ts_random.get_rng_tracker()
    if not (module.training and module.__dict__.get(_DRAWS_ATTR, True) and ts_random.MODEL_PARALLEL in tracker.names()):
        module.__dict__.setdefault(_FORK_ATTR, []).append(None)
        return
    resume = None
    # Kept under no_grad too: reentrant checkpointing runs the first forward without gradients.
    entries = module.__dict__.setdefault(_ENTRIES_ATTR, collections.OrderedDict())
    key = ts_random.default_state_digest()
    if torch._C._current_graph_task_id() != -1 and key in entries:  # a recompute inside backward
        resume = tracker.stream_state(ts_random.MODEL_PARALLEL)
        tracker.set_stream_state(ts_random.MODEL_PARALLEL, entries.pop(key))
    else:
        entries[key] = tracker.stream_state(ts_random.MODEL_PARALLEL)
        while len(entries) > _ENTRIES_KEPT:
            entries.popitem(last=False)
    context = ts_random.fork()
    context.__enter__()
    module.__dict__.setdefault(_FORK_ATTR, []).append((context, resume))


def _leave_model_parallel_stream(module, args, output):
    from ... import random as ts_random
    stack = module.__dict__.get(_FORK_ATTR)
    entry = stack.pop() if stack else None
    if entry is not None:
        context, resume = entry
        context.__exit__(None, None, None)
        if resume is not None:  # a recompute does not advance the stream
            ts_random.get_rng_tracker().set_stream_state(ts_random.MODEL_PARALLEL, resume)
