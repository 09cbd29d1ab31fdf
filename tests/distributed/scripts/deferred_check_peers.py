"""Two ranks on two GPUs (NCCL), one of them with a bad argument to the parallel loss; every rank
must raise a clear error, none may wait for the group's timeout (docs/cuda.md, "Errors without
host synchronisation"). Prints one JSON line per rank:
{"raised_at": <the group's launch count when it raised, or null>, "error": ..., "seconds": ...,
 "after": <what a further collective on the group did: "ok" or its error>}.

Arguments: kind, the group's timeout in seconds.
- "target": rank 1's targets hold an out-of-range class (found on the device): both ranks raise at
  the same launch, the 8th after the loss's gather; the group works again.
- "shard": rank 1's logits have another class count than its shard of num_classes (found on its
  host): rank 1 raises at once and leaves the group's collectives, rank 0 raises at its 8th launch
  after the gather (or sooner, when its watchdog reads the verdict first) and aborts its
  communicator; neither waits for the timeout.
- "backward": the same misbuilt shard after a column-parallel linear layer, and rank 0 runs the
  backward (the input gradient's all-reduce, which rank 1 never joins) and loss.item(): its watchdog
  reads the verdict as soon as the check's copy is on the host and aborts, so the backward or the
  sync after it raises instead of waiting for the timeout."""
import datetime
import json
import os
import sys
import time

import torch

import shardtorch as ts
from shardtorch import _C

kind, timeout_s = sys.argv[1], float(sys.argv[2])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
ts.distributed.init_process_group(group_size=2, timeout=datetime.timedelta(seconds=timeout_s))
rank = ts.distributed.get_rank()
ones = torch.ones(2, device="cuda")
torch.ops.shard.reduce(ones, "tp")  # the communicator exists before the clock starts
torch.cuda.synchronize()

classes = 10  # 5 per rank
width = 4 if (kind in ("shard", "backward") and rank == 1) else 5
logits = torch.randn(3, width, device="cuda")
target = torch.tensor([0, 7, 99 if (kind == "target" and rank == 1) else 3], device="cuda")
start = time.monotonic()
raised_at, error = None, None
try:
    if kind == "backward":
        x = torch.randn(3, 6, device="cuda", requires_grad=True)
        weight = torch.randn(width, 6, device="cuda")
        logits = torch.ops.shard.parallel_linear(x, weight, None, 1, "tp")
        loss = torch.ops.shard.parallel_cross_entropy(logits, target, group="tp", num_classes=classes)
        loss.backward()
        loss.item()
        ts.distributed.check_deferred()
    else:
        torch.ops.shard.parallel_cross_entropy(logits, target, group="tp", num_classes=classes)
        for _ in range(20):
            torch.ops.shard.reduce(ones, "tp")
except RuntimeError as e:
    raised_at, error = _C._deferred_check_counts("tp")["launches"], str(e).splitlines()[0]
seconds = time.monotonic() - start
try:
    torch.ops.shard.reduce(ones, "tp")
    torch.cuda.synchronize()
    after = "ok"
except RuntimeError as e:
    after = str(e).splitlines()[0]
print(json.dumps({"raised_at": raised_at, "error": error, "seconds": seconds, "after": after}), flush=True)
os._exit(0)
