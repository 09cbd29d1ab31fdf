"""torch.compile's caches and the rank.

The ops read this rank's place in its group when they run (the vocabulary
offset of ``parallel_embedding``, the class offset of the parallel loss, which
slice ``scatter`` keeps); AOTAutograd traces through their autograd and
writes those facts into the forward and backward graphs it stores. Its cache
(and inductor's) is keyed by the graph Dynamo captured, which is the same on
every rank of a group whose shards have the same shapes, and torch shares one
cache directory between the processes of a machine. Without more to key on, a
later run of one rank loads the graphs another rank stored, and computes with
that rank's offsets: silently wrong. So shardtorch adds this rank's place in
the world and in each of its groups to ``torch.compiler.config.cache_key_tag``,
which every torch.compile cache keys on. The ranks then no longer share
entries (each compiles its own graphs once); a tag the user set is kept in
front of it."""
from typing import Dict, List

import torch

_MARK = " |shardtorch "


def _user_tag() -> str:
    return torch.compiler.config.cache_key_tag.split(_MARK)[0]


def key_compile_caches_by_rank(rank: int, world: int, groups: Dict[str, List[int]]) -> None:
    """Sets the tag to the user's, then this rank's place: global ``rank`` of ``world`` and the global ranks
    of each group (``{name: ranks}``), which together fix every rank-dependent fact an op reads."""
    facts = " ".join(f"{name}={','.join(map(str, ranks))}" for name, ranks in sorted(groups.items()))
    torch.compiler.config.cache_key_tag = f"{_user_tag()}{_MARK}rank={rank}/{world} {facts}"


def forget_rank_in_compile_caches() -> None:
    torch.compiler.config.cache_key_tag = _user_tag()
