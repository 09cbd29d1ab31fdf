"""Two ranks, one GPU each, that never call torch.cuda.set_device: the user
starts torch.distributed with the backend given as argument ("nccl", "gloo" or
"cpu:gloo,cuda:nccl"), then shardtorch's groups on top. Each rank runs the
shard ops on its own GPU (cuda:LOCAL_RANK) while the current device stays
cuda:0 on both, including an uneven NCCL gather (5 features over 2 ranks) and a
CPU tensor through the same group, and checks them against what it computes
alone. Prints one JSON line: {"ok": ..., "device": ..., "error": ...}."""
import json
import os
import sys

import torch
import torch.distributed as dist

import shardtorch as ts

backend = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
result = {"ok": False, "device": str(device), "error": None}
try:
    dist.init_process_group(backend=backend, init_method="env://")
    ts.distributed.init_process_group(group_size=world)
    assert torch.cuda.current_device() == 0  # nobody chose a device

    # An uneven gather: rank 0 holds 3 features, rank 1 holds 2.
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(4, 5, generator=g)
    sizes, offset = [3, 2], [0, 3][rank]
    mine = whole[:, offset:offset + sizes[rank]].contiguous().to(device)
    gathered = torch.ops.shard.gather_replicated(mine, -1, "tp", 5)
    torch.testing.assert_close(gathered.cpu(), whole)
    gathered_unknown = torch.ops.shard.all_gather(mine, -1, "tp", None)  # sizes exchanged
    torch.testing.assert_close(gathered_unknown.cpu(), whole)

    # A column-parallel head and the loss on it, against the whole computation.
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(7, 8, generator=g)
    target = torch.randint(0, 7, (6,), generator=g)
    local = ts._C.shard_size(7, world, rank)
    start = ts._C.shard_offset(7, world, rank)
    logits = torch.ops.shard.parallel_linear(x.to(device), w[start:start + local].to(device), None,
                                             1, "tp")
    loss = torch.ops.shard.parallel_cross_entropy(logits, target.to(device), None, -100, 0.0, 0.0,
                                                  1, "tp", 7)
    torch.testing.assert_close(loss.cpu(), torch.nn.functional.cross_entropy(x @ w.t(), target))

    # CPU tensors through the same group (a CPU backend even under "nccl").
    summed = torch.ops.shard.reduce(torch.full((3,), float(rank + 1)), "tp")
    torch.testing.assert_close(summed, torch.full((3,), 3.0))
    torch.cuda.synchronize(device)
    result["ok"] = True
except Exception as e:  # noqa: BLE001 - reported to the test
    result["error"] = repr(e)
print(json.dumps(result), flush=True)
ts.distributed.destroy_process_group()
if dist.is_initialized():
    dist.destroy_process_group()
