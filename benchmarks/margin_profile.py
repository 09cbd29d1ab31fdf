"""Where a rank's margin-head training step spends its time: torch.profiler's
top ops by self CPU time, for one rank's share of a large class count.

``--world-size 1`` (the default): one process is a world of one rank (Gloo
over a file store) holding ``--classes`` classes, i.e. one rank's shard
(500,000 = 1M classes over 2 ranks), with ``--rows`` rows (256 = 2 ranks of
128 gathered, as margin.py's step sees them). The head's local work is that
rank's (the driver decides its path from the most columns any rank holds,
which is this shard); only the collectives, here of one rank, are missing.

``--world-size N``: N processes (Gloo), each holding ``--classes`` classes
(N x classes in all) and ``--rows`` / N rows of its own, gathered
(ts.distributed.gather_replicated) before the loss as in margin.py; each step
starts and ends at a barrier, so its time is the slowest rank's. Each rank's
table shows, beside the ops, how long it waited in each collective
("shard::wait all_gather", "shard::wait all_reduce": the collective itself
and the wait for the slowest rank to reach it).

Embedding ``--features``, ArcFace s=64 m=0.5, one thread per rank. Step:
forward, backward and ts.optim.RowSparseSGD (momentum 0.9, weight decay 5e-4)
on the weight, as in margin.py; one warm-up step, then ``--iters`` timed steps
(median printed), then one profiled step.

    python benchmarks/margin_profile.py [--world-size 1] [--classes 500000] [--rows 256]
        [--features 512] [--rate 1.0] [--precision float32|bf16] [--iters 2] [--top 15] [--shapes]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SCALE, MARGIN = 64.0, 0.5


def profile_steps(args, world_size):
    """This rank's step times and profile table (the group is initialised)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import shardtorch as ts

    rank = ts.distributed.get_group_rank()
    torch.manual_seed(0)
    loss_fn = ts.nn.ParallelMarginLoss(args.features, args.classes * world_size, SCALE, (1.0, MARGIN, 0.0),
                                       seed=1, sample_rate=args.rate)
    g = torch.Generator().manual_seed(2)
    x_all = torch.randn(args.rows, args.features, generator=g)
    target = torch.randint(0, args.classes * world_size, (args.rows,), generator=g)
    mine = args.rows // world_size
    x = x_all[rank * mine:(rank + 1) * mine].clone().requires_grad_()
    opt = ts.optim.RowSparseSGD([loss_fn.weight], lr=0.1, momentum=0.9, weight_decay=5e-4)

    def step():
        loss_fn.weight.grad = None
        x.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=args.precision == "bf16"):
            rows = ts.distributed.gather_replicated(x, dim=0) if world_size > 1 else x
            loss = loss_fn(rows, target)
        loss.backward()
        opt.step()
        if world_size > 1:
            dist.barrier()  # the step ends (and the next starts) when every rank's has
        return loss.item()

    step()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
        step()
    table = prof.key_averages(group_by_input_shape=args.shapes).table(sort_by="self_cpu_time_total",
                                                                      row_limit=args.top)
    return {"rank": rank, "times": times, "table": table}


def report(args, world_size, ranks):
    for result in ranks:
        times = result["times"]
        print(f"### Rank {result['rank']} of {world_size}: margin step, {args.classes} classes per rank, "
              f"{args.rows} rows{' gathered' if world_size > 1 else ''}, features {args.features}, "
              f"rate {args.rate}, {args.precision}; 1 thread per rank; {common.cpu_name()}; "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"step: median {statistics.median(times) * 1e3:.0f} ms of {len(times)} "
              f"({', '.join(f'{t * 1e3:.0f}' for t in times)})")
        print(result["table"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--classes", type=int, default=500_000, help="classes per rank")
    parser.add_argument("--rows", type=int, default=256, help="rows of the loss (all ranks' together)")
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--precision", choices=("float32", "bf16"), default="float32")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--shapes", action="store_true", help="group the ops by their input shapes too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.world_size < 1 or args.rows % args.world_size:
        parser.error(f"--rows ({args.rows}) must be a multiple of --world-size ({args.world_size}) >= 1")

    import torch
    torch.set_num_threads(1)
    if args.worker:
        import shardtorch as ts
        ts.distributed.init_process_group(group_size=args.world_size)
        common.write_result(profile_steps(args, args.world_size))
        return
    if args.world_size > 1:
        ranks = common.launch(os.path.abspath(__file__), args.world_size, sys.argv[1:] + ["--worker"])
    else:
        import torch.distributed as dist

        import shardtorch as ts
        common.world_of_one("margin-profile-")
        ranks = [profile_steps(args, 1)]
        ts.distributed.destroy_process_group()
        dist.destroy_process_group()
    report(args, args.world_size, sorted(ranks, key=lambda r: r["rank"]))


if __name__ == "__main__":
    main()
