"""Class sampling with data parallelism (2 replicas of a 2-rank shard group):
the replicas of a shard keep the same classes, their positives included."""
import torch
import torch.distributed as dist

import shardtorch as ts
from tests.reference import shard_range


def case_replicas_of_a_shard_keep_the_same_classes():
    classes = 40
    dp_rank = ts.distributed.get_data_parallel_rank()
    loss_fn = ts.nn.ParallelMarginLoss(6, classes, sample_rate=0.2, dtype=torch.float64, seed=4)
    lo, hi = shard_range(classes)
    group = ts.distributed.get_data_parallel_group()
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + dp_rank)  # each replica its own batch
        y = torch.randint(0, classes, (6,), generator=g)
        loss_fn(torch.randn(6, 6, generator=g, dtype=torch.float64), y)
        kept = loss_fn.last_sampled_classes
        everyone = [None] * ts.distributed.get_data_parallel_size()
        dist.all_gather_object(everyone, (kept.tolist(), y.tolist()), group=group)
        assert all(k == everyone[0][0] for k, _ in everyone), f"step {step}: replicas differ: {everyone}"
        for _, labels in everyone:
            local = [t - lo for t in labels if lo <= t < hi]
            assert set(local) <= set(kept.tolist()), (local, kept)
