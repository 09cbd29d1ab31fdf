"""PartialFC's draw of kept classes, in time that scales with the number kept.

PartialFC draws a uniform score per class of the shard, lifts the positives
above every score and keeps the top ``keep``: O(local classes) work (a top-k
over all of them) to keep a tenth of them. Here the same distribution (the
positives plus a uniformly random subset of the other classes, of the size
that makes ``keep``) is drawn from about ``keep`` numbers, already sorted:

1. ``d`` sorted uniform draws with replacement from the ``n`` non-positive
   classes, as order statistics: cumulative sums of exponentials, scaled
   (no sort). Their distinct values (equal ones are neighbours) are a
   uniformly random subset of its size: the draws are exchangeable, so every
   subset of that size is as likely. Fewer distinct than needed: draw again
   with more (the accepted draw is still uniform).
2. A uniformly random ``m``-subset of those (``m`` = keep - positives), by a
   random permutation of their positions: uniform over all ``m``-subsets.
3. Numbered among the non-positive classes, mapped to class indices by
   skipping the positives, and merged with them, sorted, by positions
   (searchsorted against the few positives), not by a sort.

Where more than half of the non-positive classes are kept, one permutation
of them is as cheap, and is used.
"""
import torch

#: Draws per class still needed: enough that one round almost always yields
#: enough distinct classes where at most half of them are kept.
_OVERDRAW = 1.5
_MIN_DRAWS = 16


def draw_kept_classes(local: int, keep: int, positives: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sorted int64 local class indices: ``positives`` (sorted, distinct,
    fewer than ``keep``) and ``keep - len(positives)`` uniformly drawn others
    of ``range(local)``, from ``generator`` only."""
    device = positives.device
    positives = positives.to(torch.int64)
    n, m = local - positives.numel(), keep - positives.numel()
    others = _uniform_subset(n, m, generator, device)
    # Number i among the non-positives is class i + (positives at or below it):
    # the positives less their rank are the thresholds.
    thresholds = positives - torch.arange(positives.numel(), device=device)
    others = others + torch.searchsorted(thresholds, others, right=True)
    kept = torch.empty(keep, dtype=torch.int64, device=device)
    # Merged by positions: before each, every smaller one of the other set.
    kept[torch.arange(m, device=device) + torch.searchsorted(positives, others)] = others
    kept[torch.arange(positives.numel(), device=device) + torch.searchsorted(others, positives)] = positives
    return kept


def _uniform_subset(n: int, m: int, generator: torch.Generator, device) -> torch.Tensor:
    """A uniformly random ``m``-subset of ``range(n)``, sorted int64."""
    if 2 * m > n:
        keep = torch.zeros(n, dtype=torch.bool, device=device)
        keep[torch.randperm(n, generator=generator, device=device)[:m]] = True
        # m are set: nonzero_static needs no host read of the count, as nonzero() does on CUDA.
        return torch.nonzero_static(keep, size=m).squeeze(1)
    draws = max(1, int(_OVERDRAW * m) + _MIN_DRAWS)
    while True:
        distinct = _sorted_distinct_draws(n, draws, generator, device)
        if distinct.numel() >= m:
            break
        draws *= 2
    chosen = torch.zeros(distinct.numel(), dtype=torch.bool, device=device)
    chosen[torch.randperm(distinct.numel(), generator=generator, device=device)[:m]] = True
    return distinct[torch.nonzero_static(chosen, size=m).squeeze(1)]


def _sorted_distinct_draws(n: int, draws: int, generator: torch.Generator, device) -> torch.Tensor:
    """The distinct values of ``draws`` uniform draws from ``range(n)``, sorted."""
    # Order statistics of uniforms: S_i / S_{draws+1} for S the running sums
    # of draws + 1 exponentials, in float64 (exact enough for any class count).
    gaps = torch.empty(draws + 1, dtype=torch.float64, device=device).exponential_(generator=generator)
    sums = gaps.cumsum(0)
    values = (sums[:-1] * (n / sums[-1])).floor_().to(torch.int64).clamp_(max=n - 1)
    fresh = torch.ones(draws, dtype=torch.bool, device=device)
    fresh[1:] = values[1:] != values[:-1]
    return values[fresh]
