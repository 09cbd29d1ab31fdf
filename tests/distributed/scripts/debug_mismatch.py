"""SHARDTORCH_DEBUG=1: ranks that call a collective with different shapes all
get an error naming the rank that disagrees; ranks whose parallel loss gets
different targets (labels) all get an error naming the rank and the first
differing element, for the plain and the fused loss. Prints one JSON line per
rank."""
import json
import os

import torch

import shardtorch as ts
from shardtorch.distributed import collectives

ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
rank = ts.distributed.get_rank()
ok = ts.distributed.reduce(torch.ones(2, 3))  # agreeing calls pass
columns = 4 if rank == 1 else 3
try:
    ts.distributed.reduce(torch.ones(2, columns))
    error = None
except RuntimeError as e:
    error = str(e)

# The package's own collectives (checkpoints, the loader's verdicts) are checked the same way.
try:
    collectives.broadcast(torch.ones(columns), src=0)
    layer_error = None
except RuntimeError as e:
    layer_error = str(e)

size = ts.distributed.get_group_size()
logits = torch.randn(5, ts._C.shard_size(11, size, ts.distributed.get_group_rank()))
target = torch.tensor([1, 2, 3, 4, 5])
same = torch.ops.shard.parallel_cross_entropy(logits, target, None, -100, 0.0, 0.0, 1, "tp", 11)
if rank == 1:
    target[3] = 7  # another data order: a silent wrong loss without the check
target_errors = {}
for name, call in {
    "plain": lambda: torch.ops.shard.parallel_cross_entropy(logits, target, None, -100, 0.0, 0.0, 1, "tp", 11),
    "fused": lambda: ts.nn.functional.parallel_linear_cross_entropy(
        torch.randn(5, 4), ts.nn.ParallelLinear(4, 11, dim=1).weight, None, target, num_classes=11),
}.items():
    try:
        call()
        target_errors[name] = None
    except RuntimeError as e:
        target_errors[name] = str(e)
print(json.dumps({"rank": rank, "sum_ok": ok.sum().item(), "error": error, "layer_error": layer_error, "same_targets_loss": same.item(),
                  "target_errors": target_errors}), flush=True)
ts.distributed.destroy_process_group()
