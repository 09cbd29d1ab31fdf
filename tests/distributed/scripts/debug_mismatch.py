"""SHARDTORCH_DEBUG=1: ranks that call a collective with different shapes all
get an error naming the rank that disagrees. Prints one JSON line per rank."""
import json
import os

import torch

import shardtorch as ts

ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
rank = ts.distributed.get_rank()
ok = ts.distributed.reduce(torch.ones(2, 3))  # agreeing calls pass
columns = 4 if rank == 1 else 3
try:
    ts.distributed.reduce(torch.ones(2, columns))
    error = None
except RuntimeError as e:
    error = str(e)
print(json.dumps({"rank": rank, "sum_ok": ok.sum().item(), "error": error}), flush=True)
ts.distributed.destroy_process_group()
