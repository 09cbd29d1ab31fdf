"""Functional forms of the parallel layers (``ts.nn.functional``)."""
from typing import Optional

import torch
import torch.nn.functional as F


from ..distributed import collectives
from ..distributed.state import TENSOR_PARALLEL, get_group
from ..utils.parallel_dim import get_parallel_full_size, is_sharded_on_last_dim, register_parallel_dim
from .parallel.plain_ddp import check_active_ddp


def parallel_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    dim: Optional[int] = None, group: str = TENSOR_PARALLEL) -> torch.Tensor:
    """y = input weight^T + bias with ``weight`` this rank's shard; see
    ParallelLinear for ``dim``. As the layer (and TorchShard), a
    column-parallel output is marked as sharded on its last dim."""
    check_active_ddp()
    output = torch.ops.shard.parallel_linear(input, weight, bias, dim, group)
    if dim in (1, -1):
        register_parallel_dim(output, -1)
    return output


def parallel_embedding(input: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int] = None,
                       max_norm: Optional[float] = None, norm_type: float = 2.0,
                       scale_grad_by_freq: bool = False, sparse: bool = False,
                       num_embeddings: Optional[int] = None, dim: Optional[int] = None,
                       group: str = TENSOR_PARALLEL) -> torch.Tensor:
    """F.embedding with ``weight`` this rank's shard of the table (TorchShard's
    signature); ``dim`` as ParallelEmbedding's (None: F.embedding itself).
    ``num_embeddings``: the whole vocabulary for dim=0 (None: the sum of the
    group's shards, one more tiny collective); ``padding_idx`` a global index."""
    if dim is None:
        return F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if dim not in (0, 1, -1) or isinstance(dim, bool):
        raise ValueError(f"parallel_embedding: dim must be None, 0, 1 or -1, got {dim!r}")
    check_active_ddp()
    split = dim % 2
    full_size = num_embeddings if split == 0 else None
    if full_size is None:
        local = torch.tensor([weight.shape[split]], dtype=torch.int64)
        collectives.all_reduce(local, group=get_group(group))
        full_size = int(local)
    if max_norm is not None:
        with torch.no_grad():
            torch.ops.shard.parallel_embedding_renorm_(weight, input, max_norm, norm_type, split, full_size, group)
    return torch.ops.shard.parallel_embedding(input, weight, padding_idx, split, full_size, scale_grad_by_freq,
                                              sparse, group)


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
#: Classes per chunk of the fused classifier + loss: O(max(rows x chunk, 2**22)) memory (docs/parallel_cross_entropy.md).
DEFAULT_CHUNK_SIZE = 4096


def _reduction_code(reduction: str, fn: str) -> int:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    return _REDUCTIONS[reduction]


def _legacy_reduction(size_average: Optional[bool], reduce: Optional[bool]) -> str:
    # torch.nn._reduction.legacy_get_string's rule: both default to True.
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    return "none" if not reduce else ("mean" if size_average else "sum")


class ParallelCrossEntropy:
    """TorchShard's name for the parallel loss as an autograd function:
    ``ParallelCrossEntropy.apply(input, target, weight, size_average,
    ignore_index, reduce, reduction)`` is
    ``parallel_cross_entropy(input, target, ..., parallel=True)``."""

    @staticmethod
    def apply(input: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None,
              size_average: Optional[bool] = None, ignore_index: int = -100, reduce: Optional[bool] = None,
              reduction: str = "mean") -> torch.Tensor:
        return parallel_cross_entropy(input, target, weight, ignore_index, reduction, parallel=True,
                                      size_average=size_average, reduce=reduce)


def _plain_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, z_loss):
    """F.cross_entropy on whole logits, plus the same z-loss term as the op."""
    moved_input, moved_target = input, target
    if input.dim() > 2:  # torch wants classes in dim 1 (a probability target's too)
        moved_input = input.movedim(-1, 1)
        moved_target = target.movedim(-1, 1) if target.is_floating_point() else target
    loss = F.cross_entropy(moved_input, moved_target, weight=weight, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    if z_loss == 0.0:
        return loss
    lse = torch.logsumexp(input.float() if input.dtype in (torch.float16, torch.bfloat16) else input, -1)
    if target.is_floating_point():  # probabilities: every row counts, mean divides by the rows
        z = z_loss * lse * lse
        if reduction == "none":
            return loss + z.to(loss.dtype)
        return loss + (z.sum() if reduction == "sum" else z.mean()).to(loss.dtype)
    valid = target != ignore_index
    z = torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return loss + z.to(loss.dtype)
    if reduction == "sum":
        return loss + z.sum().to(loss.dtype)
    if weight is not None:
        denominator = torch.where(valid, weight[target.clamp(0, weight.numel() - 1)], 0).sum()
    else:
        denominator = valid.sum()
    return loss + (z.sum() / denominator).to(loss.dtype)


def parallel_cross_entropy(input: torch.Tensor, target: torch.Tensor,
                           weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                           reduction: str = "mean", label_smoothing: float = 0.0,
                           z_loss: float = 0.0, parallel: Optional[bool] = None,
                           group: str = TENSOR_PARALLEL,
                           num_classes: Optional[int] = None, *, size_average: Optional[bool] = None,
                           reduce: Optional[bool] = None) -> torch.Tensor:
    """torch.nn.functional.cross_entropy of logits sharded on their last dim.

    Args:
        input: [*, classes] logits; in parallel mode this rank's shard
            [*, local_classes] (the first num_classes % size ranks hold one more).
        target: [*] int64 global class indices, the same on every rank; or class
            probabilities as F.cross_entropy takes them (mixup, distillation): a
            floating tensor in the logits' dtype or float32, either sharded like
            the logits [*, local_classes] or whole [*, num_classes] (the loss
            takes this rank's columns; the last dim tells which, and where the
            two are equal, on one rank, they are the same). For probabilities
            ignore_index does not apply, smoothing and weights combine as in
            torch (``-sum_c w_c ((1 - e) p_c + e / C) log_softmax_c``), 'mean'
            divides by the number of rows, and the target gets no gradient (one
            that requires grad raises: pass ``target.detach()``).
        weight: class weights, this rank's shard [local_classes] or all [num_classes].
        ignore_index, reduction, label_smoothing: as F.cross_entropy.
        z_loss: adds ``z_loss * logsumexp(logits)**2`` to every row that is not
            ignored (unweighted); 'mean' divides it by the cross-entropy's own
            denominator (the summed target weights, or the count of rows; with
            probabilities the count of rows).
        parallel: None (default): parallel when ``input`` is marked as a
            column-parallel output (``parallel_dim`` -1 or 1), plain
            F.cross_entropy otherwise, a row-parallel (0) or unmarked input
            included (TorchShard's rule). True / False force either mode.
        group: the shardtorch group the classes are split over.
        num_classes: total classes. None (default): the full size that a
            column-parallel output carries with its mark (ParallelLinear(dim=1)
            marks out_features); for an unmarked input the ranks exchange their
            shard sizes first (one more tiny collective).
        size_average, reduce: deprecated, as in F.cross_entropy (keyword
            only here): when either is given they decide ``reduction``.

    Parallel mode: one all-gather of per-row statistics forward (when the
    number of classes is known, see ``num_classes``), nothing backward, no
    [rows, all classes] tensor anywhere; ``input`` is not modified.
    """
    if size_average is not None or reduce is not None:
        reduction = _legacy_reduction(size_average, reduce)
    code = _reduction_code(reduction, "parallel_cross_entropy")
    marked = is_sharded_on_last_dim(input)
    if parallel is None:
        parallel = marked
    if not parallel:
        return _plain_cross_entropy(input, target, weight, ignore_index, reduction,
                                    label_smoothing, z_loss)
    if num_classes is None and marked:
        num_classes = get_parallel_full_size(input)
    return torch.ops.shard.parallel_cross_entropy(input, target, weight, ignore_index,
                                                  float(label_smoothing), float(z_loss), code,
                                                  group, num_classes)


def parallel_linear_cross_entropy(input: torch.Tensor, weight: torch.Tensor,
                                  bias: Optional[torch.Tensor], target: torch.Tensor,
                                  class_weight: Optional[torch.Tensor] = None,
                                  ignore_index: int = -100, reduction: str = "mean",
                                  label_smoothing: float = 0.0, z_loss: float = 0.0,
                                  chunk_size: int = DEFAULT_CHUNK_SIZE,
                                  group: str = TENSOR_PARALLEL,
                                  num_classes: Optional[int] = None) -> torch.Tensor:
    """parallel_cross_entropy(input @ weight.T + bias, target, ...) for a
    column-parallel classifier (``weight`` [local_classes, in_features]), without
    materialising the logits: the extra memory is at most max(rows x chunk_size,
    2**22) elements for any number of classes (``chunk_size`` default 4096), or,
    where blocks of rows that size would be thinner than 128 rows, no more than
    the weight gradient. The
    target is as parallel_cross_entropy's: int64 class indices, or class
    probabilities in the input's dtype or float32, sharded like the classes
    [*, local_classes] or whole [*, num_classes] (no gradient). When
    autograd needs a gradient of a mean or sum loss of a float32/float64
    classifier, the gradients are computed in forward (three matrix products per
    row where a block of 128 rows fits, as it always does with 128 features or
    more, else the logits twice) and backward only
    scales them; otherwise backward recomputes the logits chunk by chunk. See
    docs/parallel_cross_entropy.md."""
    code = _reduction_code(reduction, "parallel_linear_cross_entropy")
    return torch.ops.shard.parallel_linear_cross_entropy(
        input, weight, bias, target, class_weight, ignore_index, float(label_smoothing),
        float(z_loss), code, int(chunk_size), group, num_classes)


def parallel_margin_cross_entropy(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                  scale: float = 64.0, margins=(1.0, 0.5, 0.0),
                                  easy_margin: bool = False, ignore_index: int = -100,
                                  reduction: str = "mean", label_smoothing: float = 0.0,
                                  sampled_classes: Optional[torch.Tensor] = None,
                                  chunk_size: int = DEFAULT_CHUNK_SIZE,
                                  group: str = TENSOR_PARALLEL,
                                  num_classes: Optional[int] = None) -> torch.Tensor:
    """The margin softmax (ArcFace, CosFace, SphereFace-style m1, combined) of a
    class-sharded classifier ``weight`` [local_classes, in_features], in the
    fused chunked head: never a [batch, classes] tensor, the collectives of
    parallel_linear_cross_entropy.

    Cosine logits of L2-normalised input and weight rows (F.normalize); the
    target's logit is ``scale * psi(cos)`` with, for ``margins = (m1, m2, m3)``,
    ``psi = cos(m1 * theta + m2) - m3`` while ``m1 * theta + m2 <= pi``, and
    insightface's fallback ``cos - m3 - m2 * sin(pi - m2)`` past it; with
    ``easy_margin`` the margin applies where ``cos > 0`` only (``psi = cos``
    elsewhere). The other classes' logits are ``scale * cos``. The loss is
    F.cross_entropy of those logits with ``ignore_index``, ``reduction`` and
    ``label_smoothing``. Ranges: scale > 0, m1 >= 1, 0 <= m2 < pi, 0 <= m3 <= 1.

    ``target``: int64 class indices; the margin is not defined for class
    probabilities (a floating target raises).

    ``sampled_classes``: None, or this rank's kept local classes (sorted int64,
    every local target among them; ParallelMarginLoss draws them): the loss is
    then over the union of the ranks' kept classes, and the weight's gradient
    is a sparse COO tensor of the kept rows (see docs/margin_loss.md).
    ``num_classes``: the total, or None for one tiny exchange of shard sizes.
    """
    code = _reduction_code(reduction, "parallel_margin_cross_entropy")
    if len(margins) != 3:
        raise ValueError(f"parallel_margin_cross_entropy: margins must be (m1, m2, m3), got {margins!r}")
    m1, m2, m3 = (float(m) for m in margins)
    return torch.ops.shard.parallel_linear_margin_cross_entropy(
        input, weight, target, float(scale), m1, m2, m3, bool(easy_margin), ignore_index,
        float(label_smoothing), code, sampled_classes, int(chunk_size), group, num_classes)


from .topk import parallel_linear_topk, parallel_topk  # noqa: E402,F401  (evaluation over sharded classes)
