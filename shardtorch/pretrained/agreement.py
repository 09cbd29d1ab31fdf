"""What every rank of a load must agree on before the next collective: each step's verdict, and the
generator that draws the weights a checkpoint lacks."""
import torch
import torch.distributed as dist

from ..distributed import collectives


def agreed(work, who: str):
    """Runs ``work`` on every rank; if any rank fails, every rank raises (its
    own error, or one naming the ranks that failed) instead of some ranks
    going on to a collective the others never reach."""
    error = None
    try:
        result = work()
    except Exception as caught:  # noqa: BLE001 - re-raised below on every rank
        error, result = caught, None
    problems = [None if error is None else f"{type(error).__name__}: {error}"]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        collectives.all_gather_object(problems, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, problem) for rank, problem in enumerate(problems) if problem]
    if failed:
        raise RuntimeError(f"{who}: failed on other ranks: " + "; ".join(f"rank {r}: {p}" for r, p in failed))
    return result


def agreed_generator() -> torch.Generator:
    """A CPU generator in the same state on every rank, seeded from rank 0's
    default generator (so ``torch.manual_seed`` before loading decides it)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        collectives.broadcast(seed, src=0)
    return torch.Generator().manual_seed(int(seed))
