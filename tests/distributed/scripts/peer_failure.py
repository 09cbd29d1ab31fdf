"""A rank that dies (mode "die") or stalls (mode "stall") while its peers run a
parallel op: the peers must fail with an error naming the group and the
collective within the timeout given to init_process_group, not hang.
Prints one JSON line per surviving rank: {"seconds": ..., "error": ...}.

Arguments: mode, timeout in seconds, device ("cpu": Gloo, the default;
"cuda": NCCL, one GPU per rank). On CUDA the op returns before the collective
runs, so each step synchronises; under SHARDTORCH_ON_COMM_FAILURE=raise the
step that meets the aborted communicator raises (the default policy ends the
process instead, with the watchdog's message on stderr).

PEER_FAILURE_DONE_FILE (optional): the surviving rank 0 creates this file once it has printed,
and a stalled rank 1 ends as soon as it sees it (at most 4 timeouts later): the stall then
lasts as long as the survivor needs, not a fixed 4 timeouts."""
import datetime
import json
import os
import sys
import time

import torch

import shardtorch as ts

mode, timeout_s = sys.argv[1], float(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]),
                                  timeout=datetime.timedelta(seconds=timeout_s))
rank = ts.distributed.get_rank()
layer = ts.nn.ParallelLinear(8, 4, dim=0, device=device)


def step():
    layer(torch.randn(2, 8, device=device))
    if device == "cuda":
        torch.cuda.synchronize()


step()  # every rank healthy once
if rank == 1:
    if mode == "die":
        os._exit(3)
    done_file, until = os.environ.get("PEER_FAILURE_DONE_FILE"), time.monotonic() + timeout_s * 4
    while time.monotonic() < until and not (done_file and os.path.exists(done_file)):
        time.sleep(0.2)  # stalled: no collective, no store call
    os._exit(0)
start = time.monotonic()
try:
    for _ in range(3):  # on CUDA the step after the abort is the one that raises
        step()
    error = None
except RuntimeError as e:
    error = str(e)
print(json.dumps({"seconds": time.monotonic() - start, "error": error,
                  "group_timeout": ts._C.group_timeout("tp")}), flush=True)
if rank == 0 and os.environ.get("PEER_FAILURE_DONE_FILE"):
    open(os.environ["PEER_FAILURE_DONE_FILE"], "w").close()
os._exit(0)
