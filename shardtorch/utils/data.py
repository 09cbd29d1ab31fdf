"""``ts.utils.data.DistributedGroupSampler``: the sampler of the 2-D layout.

Every rank of one tensor-parallel group must see the same samples (they
compute one model together); the tensor-parallel groups (the data-parallel
replicas) see disjoint parts of the dataset. That is torch's
DistributedSampler with one replica per tensor-parallel group: the number of
replicas is the data-parallel size and a rank's replica index is its
data-parallel rank (its tensor-parallel group's index, since tensor-parallel
ranks are consecutive).

For the hybrid layout (every rank its own samples, gathered before the
sharded head) use torch.utils.data.DistributedSampler over the world.
"""
from typing import Optional

from torch.utils.data import Dataset, DistributedSampler

from ..distributed import state


class DistributedGroupSampler(DistributedSampler):
    """Like torch's DistributedSampler, per tensor-parallel group.

    Args:
        dataset: the dataset to sample from.
        num_replicas: number of data-parallel replicas (default: the
            data-parallel size of shardtorch's groups, world / group_size).
        rank: this rank's replica index, the same on every rank of one
            tensor-parallel group (default: the data-parallel rank).
        shuffle, seed, drop_last: as torch's DistributedSampler: the
            permutation is seeded with ``seed + epoch`` (call ``set_epoch``
            every epoch), identical on every rank; without drop_last the
            index list is padded by repeating its start so that every
            replica gets the same number of samples.
    """

    def __init__(self, dataset: Dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None:
            num_replicas = state.get_data_parallel_size()
        if rank is None:
            rank = state.get_data_parallel_rank()
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"DistributedGroupSampler: num_replicas must be a positive int (the "
                             f"data-parallel size), got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedGroupSampler: rank must be in [0, num_replicas={num_replicas}) "
                             f"(the data-parallel rank), got {rank!r}")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
