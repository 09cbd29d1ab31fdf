"""Which slice of a split dimension a rank holds, by the split rule of the C++
core (the first ``total % parts`` ranks hold one more)."""
from typing import Tuple

from .. import _C


def shard_range(total: int, parts: int, rank: int) -> Tuple[int, int]:
    """[start, stop) of ``rank``'s shard of ``total`` elements over ``parts`` ranks."""
    start = _C.shard_offset(total, parts, rank)
    return start, start + _C.shard_size(total, parts, rank)
