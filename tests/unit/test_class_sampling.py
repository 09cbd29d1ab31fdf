"""The margin loss's draw of kept classes (shardtorch/nn/class_sampling.py),
no processes: its result is the positives plus distinct others, sorted, of
the exact size, reproducible from the generator; and every subset of the
others is equally likely (counted over many draws, against the uniform
distribution written out)."""
import itertools
import math

import pytest
import torch

from shardtorch.nn import class_sampling
from shardtorch.nn.class_sampling import draw_kept_classes


def _draw(local, keep, positives, seed):
    return draw_kept_classes(local, keep, torch.tensor(positives, dtype=torch.int64),
                             torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("local,keep,positives", [
    (10, 3, []), (10, 9, [0, 9]), (500_000, 50_000, [0, 1, 17, 499_999]), (1000, 100, list(range(0, 99))),
    (7, 7, [3]), (1, 1, []), (100_000, 1, []),
])
def test_positives_and_distinct_others_sorted_of_the_exact_size(local, keep, positives):
    kept = _draw(local, keep, positives, 3)
    assert kept.dtype == torch.int64 and kept.shape == (keep,)
    assert torch.equal(kept, torch.unique(kept)), "not sorted and distinct"
    assert kept.min() >= 0 and kept.max() < local
    assert torch.isin(torch.tensor(positives, dtype=torch.int64), kept).all()
    assert torch.equal(kept, _draw(local, keep, positives, 3)), "the same generator must draw the same classes"
    if keep - len(positives) > 1 and local - len(positives) > keep - len(positives):
        assert not torch.equal(kept, _draw(local, keep, positives, 4)), "another seed, the same draw"


def _subset_counts(local, keep, positives, draws):
    counts = {}
    for seed in range(draws):
        others = tuple(c for c in _draw(local, keep, positives, seed).tolist() if c not in positives)
        counts[others] = counts.get(others, 0) + 1
    return counts


@pytest.mark.parametrize("local,keep,positives", [
    (7, 3, [2]),      # 2 of 6 others, fewer than half: the draws with replacement
    (6, 5, []),       # 5 of 6, more than half: one permutation
    (8, 4, [0, 7]),   # positives at both ends
])
def test_every_subset_of_the_others_is_equally_likely(local, keep, positives):
    draws = 6000
    others = [c for c in range(local) if c not in positives]
    subsets = list(itertools.combinations(others, keep - len(positives)))
    counts = _subset_counts(local, keep, positives, draws)
    assert set(counts) <= set(subsets), f"drawn, but not subsets of the others: {set(counts) - set(subsets)}"
    expected = draws / len(subsets)
    chi2 = sum((counts.get(s, 0) - expected) ** 2 / expected for s in subsets)
    # Chi-square with len(subsets) - 1 degrees of freedom: mean k, sd sqrt(2k); 6 sd is never reached by chance.
    k = len(subsets) - 1
    assert chi2 < k + 6 * math.sqrt(2 * k), f"chi-square {chi2:.1f} over {k} degrees of freedom: {counts}"


def test_too_few_distinct_draws_draw_again(monkeypatch):
    """With almost no overdraw the first round often falls short; the result
    is still of the exact size and uniform."""
    monkeypatch.setattr(class_sampling, "_OVERDRAW", 0.5)
    monkeypatch.setattr(class_sampling, "_MIN_DRAWS", 0)
    kept = _draw(1000, 400, [5], 1)
    assert kept.shape == (400,) and torch.equal(kept, torch.unique(kept))
    test_every_subset_of_the_others_is_equally_likely(7, 3, [2])


def test_inclusion_frequency_is_uniform_at_scale():
    """Over 200 draws of 1,000 of 20,000 classes each class is kept about
    1/20 of the time, with no drift along the class index."""
    local, keep, draws = 20_000, 1_000, 200
    counts = torch.zeros(local)
    for seed in range(draws):
        counts[_draw(local, keep, [], seed)] += 1
    p = keep / local
    assert abs(counts.sum().item() - keep * draws) == 0
    # 20 bands of 1,000 classes: each band's count is about draws * keep / 20, sd ~ sqrt(that).
    bands = counts.view(20, -1).sum(1)
    mean = draws * keep / 20
    assert (bands - mean).abs().max() < 6 * math.sqrt(mean * (1 - p)), bands
