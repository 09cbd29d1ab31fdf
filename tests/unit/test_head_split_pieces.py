"""Head-aligned and fused splits (shardtorch.utils.shard_facts.split_pieces),
against the rule written plainly: heads dealt out in contiguous runs, the
first ``heads % size`` ranks one more, the same heads from each fused part."""
import pytest

from shardtorch.utils.shard_facts import split_pieces


def _plain(heads, size, rank, blocks, unit):
    counts = [heads // size + (1 if r < heads % size else 0) for r in range(size)]
    first = sum(counts[:rank])
    mine = range(first, first + counts[rank])
    indices = [b * heads * unit + h * unit + i for b in range(blocks) for h in mine for i in range(unit)]
    return indices


@pytest.mark.parametrize("heads,size,blocks,unit", [(12, 5, 3, 64), (10, 3, 3, 6), (10, 4, 1, 6), (5, 4, 1, 12),
                                                    (4, 3, 1, 12), (97, 4, 1, 1), (8, 3, 3, 1)])
def test_pieces_hold_whole_heads_from_every_part(heads, size, blocks, unit):
    covered = []
    for rank in range(size):
        pieces = split_pieces(blocks * heads * unit, size, rank, blocks, unit)
        indices = [offset + i for offset, length in pieces for i in range(length)]
        assert indices == _plain(heads, size, rank, blocks, unit), (rank, pieces)
        covered += indices
    assert sorted(covered) == list(range(blocks * heads * unit))


def test_twelve_heads_over_five_ranks_are_three_three_two_two_two():
    sizes = [sum(length for _, length in split_pieces(3 * 12 * 64, 5, rank, 3, 64)) // (3 * 64) for rank in range(5)]
    assert sizes == [3, 3, 2, 2, 2]


def test_a_size_that_is_not_whole_heads_is_refused():
    with pytest.raises(ValueError, match="not blocks"):
        split_pieces(100, 2, 0, 3, 6)
