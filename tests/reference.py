"""Helpers for comparing shardtorch against unsharded torch, and for expecting errors."""
import re

import torch

import shardtorch as ts


def split_range(total: int, parts: int, rank: int):
    """[start, stop) of ``rank``'s slice of ``total`` over ``parts`` by the
    split rule, in plain arithmetic (independent of the core's): the first
    ``total % parts`` ranks hold one more."""
    base, extra = divmod(total, parts)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_range(total: int, group: str = "tp"):
    """This rank's [start, stop) of ``total`` over ``group``."""
    return split_range(total, ts.distributed.get_group_size(group), ts.distributed.get_group_rank(group))


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


def cross_entropy_reference(logits, target, weight=None, ignore_index=-100, reduction="mean",
                            label_smoothing=0.0, z_loss=0.0):
    """F.cross_entropy on whole logits [*, C] plus the documented z-loss term:
    z_loss * logsumexp^2 for each row that is not ignored, unweighted, and for
    'mean' divided by F.cross_entropy's own denominator."""
    import torch.nn.functional as F

    moved = logits.movedim(-1, 1) if logits.dim() > 2 else logits
    loss = F.cross_entropy(moved, target, weight=weight, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    if z_loss == 0.0:
        return loss
    lse = torch.logsumexp(logits, -1)
    valid = target != ignore_index
    z = torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return loss + z
    if reduction == "sum":
        return loss + z.sum()
    if weight is None:
        denominator = valid.sum()
    else:
        denominator = torch.where(valid, weight[target.clamp(0, weight.numel() - 1)], 0).sum()
    return loss + z.sum() / denominator


def probability_cross_entropy_reference(logits, probs, weight=None, reduction="mean",
                                       label_smoothing=0.0, z_loss=0.0):
    """F.cross_entropy of whole logits [*, C] with a class-probability target
    [*, C] plus the documented z-loss term: z_loss * logsumexp^2 for every row
    (no row is ignored), for 'mean' divided by the rows, as F.cross_entropy
    divides the cross-entropy itself."""
    import torch.nn.functional as F

    moved, moved_probs = logits, probs
    if logits.dim() > 2:
        moved, moved_probs = logits.movedim(-1, 1), probs.movedim(-1, 1)
    loss = F.cross_entropy(moved, moved_probs, weight=weight, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss == 0.0:
        return loss
    z = z_loss * torch.logsumexp(logits, -1) ** 2
    return loss + {"none": z, "sum": z.sum(), "mean": z.mean()}[reduction]


def expect_error(fn, *fragments, exception=Exception, match=None) -> str:
    """Calls ``fn`` and returns the message of the ``exception`` it must
    raise, which must contain every fragment and, when given, a match of the
    regular expression ``match``. No error, or another type of error, fails."""
    try:
        fn()
    except exception as e:
        message = str(e)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in {type(e).__name__}: {message}"
        assert match is None or re.search(match, message), f"{match!r} does not match {type(e).__name__}: {message}"
        return message
    except Exception as e:  # noqa: BLE001 - only reached when `exception` is narrower
        raise AssertionError(f"expected {exception}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"no error; expected {exception} mentioning {fragments or match!r}")


def margin_logits_reference(x, full_weight, target, scale, margins, easy_margin=False,
                            ignore_index=-100):
    """The margin softmax's logits [*, C] written out plainly, differentiable
    by autograd: cosines of F.normalize'd rows, the target's replaced by
    cos(m1 * theta + m2) - m3 while m1 * theta + m2 < pi and by insightface's
    fallback cos - m3 - m2 * sin(pi - m2) past it (easy_margin: the margin
    where cos > 0, cos itself elsewhere), times scale."""
    import math

    import torch.nn.functional as F

    m1, m2, m3 = margins
    cos = F.normalize(x, dim=-1) @ F.normalize(full_weight, dim=-1).t()
    valid = target != ignore_index
    column = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(-1)
    c = cos.gather(-1, column).squeeze(-1)
    theta = torch.acos(c.clamp(-1.0, 1.0))
    margined = torch.cos(m1 * theta + m2) - m3
    if easy_margin:
        psi = torch.where(c > 0, margined, c)
    else:
        psi = torch.where(m1 * theta + m2 < math.pi, margined, c - m3 - m2 * math.sin(math.pi - m2))
    onehot = torch.zeros_like(cos, dtype=torch.bool).scatter_(-1, column, valid.unsqueeze(-1))
    return scale * torch.where(onehot, psi.unsqueeze(-1).expand_as(cos), cos)


def margin_cross_entropy_reference(x, full_weight, target, scale, margins, easy_margin=False,
                                   ignore_index=-100, reduction="mean", label_smoothing=0.0,
                                   kept_classes=None):
    """F.cross_entropy of margin_logits_reference; with ``kept_classes`` (sorted
    global class indices) over those classes only, targets renumbered."""
    import torch.nn.functional as F

    logits = margin_logits_reference(x, full_weight, target, scale, margins, easy_margin, ignore_index)
    if kept_classes is not None:
        logits = logits.index_select(-1, kept_classes)
        position = torch.searchsorted(kept_classes, target.clamp_min(0))
        target = torch.where(target == ignore_index, target, position)
    moved = logits.movedim(-1, 1) if logits.dim() > 2 else logits
    return F.cross_entropy(moved, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def assert_compiled_matches_eager(step, inputs, tol=1e-12):
    """``step(*inputs)`` (a scalar) and the gradients of every input, eager and
    under torch.compile(fullgraph=True), agree within ``tol``."""
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        args = [t.clone().requires_grad_() for t in inputs]
        out = fn(*args)
        out.backward()
        results.append((out.detach(), [a.grad for a in args]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=tol, atol=tol)
    for eager_grad, compiled_grad in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(eager_grad, compiled_grad, rtol=tol, atol=tol)
