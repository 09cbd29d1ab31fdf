"""Bad inputs that the case runner cannot host (it initialises first, and a
rank left in a collective would stall its barrier). Mode:
  before_init  - calls made before init_process_group
  indivisible  - init_process_group with a group_size that does not divide the world
  full_size    - gathers with a full_size whose shard fits some ranks only, and with
                 full_size values that differ across ranks
  target_one_rank - a parallel loss whose targets are out of range on one rank only
  row_one      - row-parallel ParallelLinear(1, 1, dim=0) fed the scattered input (rank 0's
                 shard of 1 feature is the whole input: ranks disagree in backward)
Prints one JSON line per rank: {"rank", "results": {name: "Type: message" or null}, "seconds"}."""
import datetime
import json
import os
import sys
import time

import torch

import shardtorch as ts

mode = sys.argv[1]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])


def attempt(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"


def init_with_timeout():
    ts.distributed.init_process_group(group_size=world, timeout=datetime.timedelta(seconds=float(sys.argv[2])))


def report_after_the_timeout(seconds):
    """Stays alive until every rank is done with its calls, else past the
    timeout, so that a peer left waiting is not freed by this rank's exit (it
    times out instead, and says so), then reports. Each rank marks itself done
    with a file in BAD_SETUP_DONE_DIR (no collective); without that variable it
    stays the whole timeout."""
    done_dir, until = os.environ.get("BAD_SETUP_DONE_DIR"), time.monotonic() + float(sys.argv[2]) + 2 - seconds
    if done_dir:
        open(os.path.join(done_dir, f"done-{rank}"), "w").close()
    while time.monotonic() < until and not (
            done_dir and all(os.path.exists(os.path.join(done_dir, f"done-{r}")) for r in range(world))):
        time.sleep(0.1)
    print(json.dumps({"rank": rank, "results": results, "seconds": seconds}), flush=True)
    os._exit(0)


results = {}
start = time.monotonic()
if mode == "before_init":
    results["get_group_size"] = attempt(lambda: ts.distributed.get_group_size())
    results["parallel_linear_module"] = attempt(lambda: ts.nn.ParallelLinear(4, 4, dim=1))
    results["reduce_op"] = attempt(lambda: ts.distributed.reduce(torch.ones(2)))
    results["cross_entropy"] = attempt(lambda: ts.nn.functional.parallel_cross_entropy(
        torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), parallel=True))
elif mode == "indivisible":
    results["init"] = attempt(lambda: ts.distributed.init_process_group(group_size=world + 1))
    results["is_initialized_after"] = None if not ts.distributed.is_initialized() else "initialised"
    # The failed call leaves nothing behind: a correct call works afterwards.
    results["init_again"] = attempt(lambda: ts.distributed.init_process_group(group_size=world))
    results["reduce_after"] = attempt(lambda: ts.distributed.reduce(torch.ones(2)))
    ts.distributed.destroy_process_group()
elif mode == "full_size":
    init_with_timeout()
    # 7 over 2 ranks is 4 + 3: a [2, 3] tensor fits rank 1's shard, not rank 0's.
    start = time.monotonic()
    results["gather_replicated"] = attempt(lambda: ts.distributed.gather_replicated(torch.randn(2, 3), -1, full_size=7))
    # Shards of 7 (4 + 3), but rank 1 says full_size=8: its own check fails, rank 0's passes.
    results["different_full_size"] = attempt(lambda: ts.distributed.all_gather(
        torch.randn(2, 4 - rank), -1, full_size=7 + rank))
    report_after_the_timeout(time.monotonic() - start)
elif mode == "target_one_rank":
    init_with_timeout()
    # Only rank 1's targets are out of range (its data differs): it must not
    # leave rank 0 waiting in the loss's all-gather.
    target = torch.tensor([1, 2, 99 if rank == 1 else 3])
    logits = torch.randn(3, ts._C.shard_size(11, world, rank), requires_grad=True)
    x, w = torch.randn(3, 4), ts.nn.ParallelLinear(4, 11, dim=1).weight
    start = time.monotonic()
    results["plain"] = attempt(lambda: ts.nn.functional.parallel_cross_entropy(logits, target, parallel=True,
                                                                               num_classes=11))
    results["fused"] = attempt(lambda: ts.nn.functional.parallel_linear_cross_entropy(x, w, None, target,
                                                                                     num_classes=11))
    report_after_the_timeout(time.monotonic() - start)
elif mode == "row_one":
    init_with_timeout()
    layer = ts.nn.ParallelLinear(1, 1, bias=False, dim=0, dtype=torch.float64)
    x = torch.ones(1, 1, dtype=torch.float64, requires_grad=True)
    start = time.monotonic()
    results["forward_backward"] = attempt(lambda: layer(ts.distributed.scatter(x, -1)).sum().backward())
    report_after_the_timeout(time.monotonic() - start)
print(json.dumps({"rank": rank, "results": results, "seconds": time.monotonic() - start}), flush=True)
os._exit(0)
