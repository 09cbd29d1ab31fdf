"""A peer that exits while its parent does not reap it (a zombie): its survivor must fail at once,
naming the dead peer, not at the group's timeout.

This process is rank 0 and forks rank 1 before anything else; rank 1 runs one healthy step and
exits, and rank 0, its parent, reaps nothing while it waits in the next collective (a small
all-reduce: the shared-memory path). kill(pid, 0) still succeeds on rank 1 then. Rank 0 prints one
JSON line: {"error": ...}.

Arguments: the store's port, the group's timeout in seconds."""
import os
import sys

port, timeout_s = sys.argv[1], float(sys.argv[2])
child = os.fork()  # before torch: nothing to duplicate but the interpreter
rank = 1 if child == 0 else 0
os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "SHARDTORCH_SHARED_MEMORY": "1"})

import datetime  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

import shardtorch as ts  # noqa: E402

ts.distributed.init_process_group(group_size=2, timeout=datetime.timedelta(seconds=timeout_s))
layer = ts.nn.ParallelLinear(8, 4, dim=0)
layer(torch.randn(2, 8))  # both ranks healthy once
if rank == 1:
    os._exit(3)  # a zombie until rank 0 exits: rank 0 never waits for it
try:
    layer(torch.randn(2, 8))
    error = None
except RuntimeError as e:
    error = str(e)
print(json.dumps({"error": error, "child": child}), flush=True)
os._exit(0)
