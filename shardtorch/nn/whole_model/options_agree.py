"""Options that every rank of a group must pass alike (``plan``, ``logits``,
``sequence_parallel``, ``verbose``, ...): a rank that differs would build
another model, or call a collective its peers never reach (``verbose=True``
on one rank alone all-gathers the ranks' parameter bytes: a Gloo size
mismatch, or a hang). They are checked once, by one all-gather of one 64-bit
digest per option over the group; where they differ, every rank raises the
same ValueError naming the options and each rank's value."""
import contextlib
import hashlib
from typing import Dict, Optional

import torch

from ...distributed import collectives
from ...distributed import state

_checked_group: Optional[str] = None


def _canonical(value) -> str:
    if isinstance(value, dict):
        return repr(sorted((repr(k), _canonical(v)) for k, v in value.items()))
    return repr(value)


def _digest(value) -> int:
    return int.from_bytes(hashlib.sha256(_canonical(value).encode()).digest()[:8], "little", signed=True)


def check_options_agree(who: str, group: str, options: Dict[str, object]) -> None:
    """Raises ValueError on every rank of ``group`` if any of ``options`` ({name: value}) differs between its
    ranks (a no-op inside ``options_checked(group)``, where a caller checked them already)."""
    size = state.get_group_size(group)
    if size == 1 or _checked_group == group:
        return
    process_group = state.get_group(group)
    mine = torch.tensor([_digest(value) for value in options.values()], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    collectives.all_gather(everyone, mine, group=process_group)
    differ = [name for i, name in enumerate(options) if any(int(d[i]) != int(everyone[0][i]) for d in everyone)]
    if not differ:
        return
    values = [None] * size  # every rank found the same options differing: all of them take part
    collectives.all_gather_object(values, {name: repr(options[name]) for name in differ}, group=process_group)
    per_option = [f"{name}: " + ", ".join(f"{v[name]} on group rank {r}" for r, v in enumerate(values))
                  for name in differ]
    raise ValueError(f"{who}: every rank of group {group!r} must pass the same {', '.join(differ)}; got "
                     + "; ".join(per_option))


@contextlib.contextmanager
def options_checked(group: str):
    """Inside, ``check_options_agree`` over ``group`` passes without communicating (from_pretrained checked
    its options, those of parallelize among them, before calling it)."""
    global _checked_group
    before, _checked_group = _checked_group, group
    try:
        yield
    finally:
        _checked_group = before
