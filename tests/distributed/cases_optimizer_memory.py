"""How much memory collect_optimizer_state_dict and
relocate_optimizer_state_dict add, per rank (2 ranks).

The model: two column-parallel layers of 1024 x 4096 float32 (16 MiB each in
full) under Adam, whose state (exp_avg, exp_avg_sq) is 64 MiB in full.
Results go to optimizer-memory-rank<r>.json in
the session's scratch folder (SHARDTORCH_TEST_SCRATCH, harness.scratch_dir)."""
import gc
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import shardtorch as ts
from tests.distributed.memory_probe import peak_extra_bytes

MiB = 1 << 20
LAYERS, IN, OUT = 2, 1024, 4096
SLACK = 12 * MiB  # allocator, Gloo and pickling overheads


def case_peak_memory_of_optimizer_collect_and_relocate():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[ts.nn.ParallelLinear(IN, OUT, bias=False, dim=1) for _ in range(LAYERS)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    full_param = IN * OUT * 4
    full_state = 2 * LAYERS * full_param
    state_shards = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                       for v in s.values() if v.dim() > 0)
    measured = {"rank": rank, "full_state_bytes": full_state, "state_shard_bytes": state_shards,
                "largest_full_tensor_bytes": full_param}
    gc.collect()
    with peak_extra_bytes(measured, "collect_to_dst0"):
        collected = ts.collect_optimizer_state_dict(model, optimizer, dst=0)
    if rank == 0:  # the values are the ones the shards hold (exp_avg = 0.1 after one step of ones)
        assert all(torch.equal(s["exp_avg"], torch.full((OUT, IN), 0.1)) for s in collected["state"].values())
    gc.collect()
    with peak_extra_bytes(measured, "relocate_from_src0"):
        local = ts.relocate_optimizer_state_dict(model, optimizer, collected if rank == 0 else None, src=0)
    assert all(tuple(s["exp_avg"].shape) == tuple(p.shape) for s, p in zip(local["state"].values(),
                                                                          model.parameters()))
    del local
    collected = None
    gc.collect()
    with open(os.path.join(os.environ["SHARDTORCH_TEST_SCRATCH"], f"optimizer-memory-rank{rank}.json"), "w") as f:
        json.dump(measured, f)
    if rank == 0:
        # dst holds the full state it returns, plus at most one full tensor in flight.
        assert measured["collect_to_dst0"] <= full_state + full_param + SLACK, measured
        # src holds the checkpoint already; it adds its own shards and one slice in flight.
        assert measured["relocate_from_src0"] <= state_shards + full_param + SLACK, measured
    else:
        # The others never hold more than their shards.
        assert measured["collect_to_dst0"] <= SLACK, measured
        assert measured["relocate_from_src0"] <= state_shards + SLACK, measured
