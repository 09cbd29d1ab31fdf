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


def _covered_once(full_size, size, parts):
    seen = []
    for rank in range(size):
        for offset, length in split_pieces(full_size, size, rank, parts=parts):
            seen += range(offset, offset + length)
    return sorted(seen) == list(range(full_size))


def test_parts_of_their_own_sizes_split_each_part_by_its_own_heads():
    # Phi-3's qkv_proj under grouped-query attention: 12 query heads of 4 in groups of 3, 4 key/value heads.
    parts = ((12 * 4, 3 * 4), (4 * 4, 4), (4 * 4, 4))
    assert split_pieces(80, 3, 0, parts=parts) == [(0, 24), (48, 8), (64, 8)]
    assert split_pieces(80, 3, 2, parts=parts) == [(36, 12), (60, 4), (76, 4)]
    assert all(_covered_once(80, size, parts) for size in (1, 2, 3, 4))


def test_a_part_with_fewer_units_than_ranks_lies_on_the_first_ranks_only():
    # Multi-query attention: 4 query heads of 8, one key and one value head.
    parts = ((32, 8), (8, 8), (8, 8))
    assert split_pieces(48, 2, 0, parts=parts) == [(0, 16), (32, 8), (40, 8)]
    assert split_pieces(48, 2, 1, parts=parts) == [(16, 16)]
    assert _covered_once(48, 3, parts)
    # A rank holding nothing at all has one empty piece.
    assert split_pieces(8, 2, 1, parts=((8, 8),)) == [(0, 0)]


def test_parts_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match="add up to"):
        split_pieces(50, 2, 0, parts=((32, 8), (8, 8)))
    with pytest.raises(ValueError, match="multiple of a positive unit"):
        split_pieces(30, 2, 0, parts=((30, 8),))
