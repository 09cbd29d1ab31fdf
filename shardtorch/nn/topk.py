"""Top-k over classes sharded across the tensor-parallel group, without
gathering the logits: each rank keeps its k best candidates, one all-gather of
[batch, k] candidates per call, and the merge picks the global k. Values and
global class indices equal torch.topk's on the gathered logits, with ties
going to the lower class index (what a stable descending sort gives).

For evaluation: the results carry no gradient."""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..distributed.mappings import all_gather
from ..distributed.state import TENSOR_PARALLEL, get_group_size

# Classes per chunk of parallel_linear_topk: bounds the [batch, chunk] logits held at once.
DEFAULT_CHUNK = 8192


def _select(values: torch.Tensor, indices: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of ``values`` [rows, n], whose ``indices`` rise
    along the row; equal values are taken lowest index first. Returned in index
    order."""
    kth = values.topk(k, dim=-1).values[:, -1:]
    greater = values > kth
    equal = values == kth
    needed = k - greater.sum(-1, keepdim=True, dtype=torch.int32)
    keep = greater | (equal & (equal.cumsum(-1, dtype=torch.int32) <= needed))
    positions = keep.nonzero()[:, 1].view(values.size(0), k)  # row-major: index order
    return values.gather(-1, positions), indices.gather(-1, positions)


def _merge_over_group(values: torch.Tensor, local_indices: torch.Tensor, local_classes: int, k: int,
                      group: str, fn: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """values/local_indices: [rows, k] candidates of this rank (index -1:
    padding). One all-gather of candidates and class counts; the global k."""
    rows = values.size(0)
    payload = torch.cat([values.double(), local_indices.double(),
                         torch.full((rows, 1), float(local_classes), dtype=torch.float64, device=values.device)],
                        dim=1)
    # One slice per rank: the gathered length is known, no size exchange.
    gathered = all_gather(payload.unsqueeze(0), dim=0, group=group,
                          full_size=get_group_size(group))  # [ranks, rows, 2k + 1]
    counts = gathered[:, 0, 2 * k].long()
    total = int(counts.sum())
    if k > total:
        raise ValueError(f"{fn}: k must be at most the number of classes {total}, got {k}")
    offsets = torch.cumsum(counts, 0) - counts
    candidate_values = gathered[:, :, :k]
    local = gathered[:, :, k:2 * k].long()
    # Padding sorts after every class: index total + its position.
    padding = total + torch.arange(local.numel(), device=local.device).view_as(local)
    global_indices = torch.where(local >= 0, local + offsets.view(-1, 1, 1), padding)
    candidate_values = candidate_values.permute(1, 0, 2).reshape(rows, -1)
    global_indices = global_indices.permute(1, 0, 2).reshape(rows, -1)
    by_index = global_indices.argsort(dim=-1)  # _select wants index order
    candidate_values, global_indices = candidate_values.gather(-1, by_index), global_indices.gather(-1, by_index)
    chosen_values, chosen_indices = _select(candidate_values, global_indices, k)
    order = torch.sort(chosen_values, dim=-1, descending=True, stable=True).indices
    return chosen_values.gather(-1, order), chosen_indices.gather(-1, order)


def _local_candidates(chunks, rows: int, k: int, dtype, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's k best of ``chunks``, an iterable of (logits [rows, c],
    first class of the chunk) in class order, padded to k."""
    values = torch.empty(rows, 0, dtype=dtype, device=device)
    indices = torch.empty(rows, 0, dtype=torch.long, device=device)
    for logits, start in chunks:
        chunk_indices = torch.arange(start, start + logits.size(1), device=device).expand(rows, -1)
        # Kept candidates have lower indices than the chunk: index order holds.
        values = torch.cat([values, logits.to(dtype)], 1)
        indices = torch.cat([indices, chunk_indices], 1)
        values, indices = _select(values, indices, min(k, values.size(1)))
    return _pad(values, indices, k)


def _check_k(k, fn: str) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{fn}: k must be a positive int, got {k!r}")


def _pad(values: torch.Tensor, indices: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fills a rank with fewer than k classes up to k candidates (value -inf, index -1)."""
    missing = k - values.size(1)
    if missing <= 0:
        return values, indices
    rows = values.size(0)
    return (torch.cat([values, values.new_full((rows, missing), float("-inf"))], 1),
            torch.cat([indices, indices.new_full((rows, missing), -1)], 1))


@torch.no_grad()
def parallel_topk(logits: torch.Tensor, k: int, group: str = TENSOR_PARALLEL) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(gathered_logits, k)`` for logits whose last dim is this
    rank's shard of the classes (any split, uneven included), without gathering
    them. Returns (values, global class indices), each [..., k], values in
    descending order, ties to the lower class index. One all-gather of
    [batch, k] candidates; no gradient."""
    fn = "parallel_topk"
    _check_k(k, fn)
    if logits.dim() < 1:
        raise ValueError(f"{fn}: logits must have a class dimension, got a 0-d tensor")
    leading = logits.shape[:-1]
    # (-1 cannot be inferred for a rank that holds no classes)
    flat = logits.reshape(math.prod(leading), logits.size(-1))
    n = flat.size(1)
    chunks = ((flat[:, start:start + DEFAULT_CHUNK], start) for start in range(0, n, DEFAULT_CHUNK))
    values, picked = _local_candidates(chunks, flat.size(0), k, flat.dtype, flat.device)
    top_values, top_indices = _merge_over_group(values, picked, n, k, group, fn)
    return top_values.to(logits.dtype).view(*leading, k), top_indices.view(*leading, k)


@torch.no_grad()
def parallel_linear_topk(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         k: int = 5, normalize: bool = False, group: str = TENSOR_PARALLEL,
                         chunk_size: int = DEFAULT_CHUNK) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k classes of a column-parallel classifier, ``input @ weight.T + bias``
    with ``weight`` this rank's rows of the classes, computed chunk by chunk of
    classes: never the [batch, classes] logits. ``normalize``: cosine logits
    (input rows and weight rows L2-normalised, as a margin-softmax head
    scores). Returns (values, global class indices) as :func:`parallel_topk`."""
    fn = "parallel_linear_topk"
    _check_k(k, fn)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    if weight.dim() != 2 or input.dim() < 1 or input.size(-1) != weight.size(1):
        raise ValueError(f"{fn}: input [..., in_features] and weight [classes, in_features] must agree, got "
                         f"input {list(input.shape)} and weight {list(weight.shape)}")
    if bias is not None and bias.shape != (weight.size(0),):
        raise ValueError(f"{fn}: bias must be [{weight.size(0)}] (this rank's classes), got {list(bias.shape)}")
    leading = input.shape[:-1]
    x = input.reshape(-1, input.size(-1))
    if normalize:
        x = F.normalize(x, dim=-1)
    n = weight.size(0)

    def chunks():
        for start in range(0, n, chunk_size):
            rows_of_weight = weight[start:start + chunk_size]
            if normalize:
                rows_of_weight = F.normalize(rows_of_weight, dim=-1)
            logits = x @ rows_of_weight.t()
            if bias is not None:
                logits = logits + bias[start:start + chunk_size]
            yield logits, start

    values, indices = _local_candidates(chunks(), x.size(0), k, torch.result_type(x, weight), x.device)
    top_values, top_indices = _merge_over_group(values, indices, n, k, group, fn)
    return top_values.to(input.dtype).view(*leading, k), top_indices.view(*leading, k)
