"""How much memory collect_state_dict and relocate_state_dict add, per rank.

The model: four column-parallel layers of 1024 x 4096 float32 (16 MiB each in
full, 64 MiB in all). Results go to memory-rank<r>.json in the
session's scratch folder (SHARDTORCH_TEST_SCRATCH, harness.scratch_dir)."""
import gc
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import shardtorch as ts
from tests.distributed.memory_probe import peak_extra_bytes

MiB = 1 << 20
LAYERS, IN, OUT = 4, 1024, 4096
SLACK = 12 * MiB  # allocator, Gloo and pickling overheads


def case_peak_memory_of_collect_and_relocate():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[ts.nn.ParallelLinear(IN, OUT, bias=False, dim=1) for _ in range(LAYERS)])
    full_param = IN * OUT * 4
    full_model = LAYERS * full_param
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = {"rank": rank, "full_model_bytes": full_model, "shard_bytes": shards,
                "largest_full_param_bytes": full_param}
    gc.collect()
    with peak_extra_bytes(measured, "collect_to_dst0"):
        collected = ts.collect_state_dict(model, model.state_dict(), dst=0)
    gc.collect()
    with peak_extra_bytes(measured, "relocate_from_src0"):
        local = ts.relocate_state_dict(model, collected if rank == 0 else None, src=0)
    del local
    collected = None
    gc.collect()
    with peak_extra_bytes(measured, "collect_to_every_rank"):
        everywhere = ts.collect_state_dict(model, model.state_dict())
    del everywhere
    with open(os.path.join(os.environ["SHARDTORCH_TEST_SCRATCH"], f"memory-rank{rank}.json"), "w") as f:
        json.dump(measured, f)
    # With dst=None every rank holds the result and at most one shard in flight.
    assert measured["collect_to_every_rank"] <= full_model + full_param + SLACK, measured
    if rank == 0:
        # dst holds the full state dict it returns, plus at most one full parameter in flight.
        assert measured["collect_to_dst0"] <= full_model + full_param + SLACK, measured
        # src holds the checkpoint already; it adds its own shards and one slice in flight.
        assert measured["relocate_from_src0"] <= shards + full_param + SLACK, measured
    else:
        # The others never hold more than their shards.
        assert measured["collect_to_dst0"] <= SLACK, measured
        assert measured["relocate_from_src0"] <= shards + SLACK, measured
