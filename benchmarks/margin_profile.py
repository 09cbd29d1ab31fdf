"""Where one rank's margin-head training step spends its time: torch.profiler's
top ops by self CPU time, for one rank's share of a large class count.

One process is a world of one rank (Gloo over a file store) holding
``--classes`` classes, i.e. one rank's shard (500,000 = 1M classes over 2
ranks), with ``--rows`` rows (256 = 2 ranks of 128 gathered, as margin.py's
step sees them), embedding ``--features``, ArcFace s=64 m=0.5, one thread. The
head's local work is that rank's (the driver decides its path from the most
columns any rank holds, which is this shard); only the collectives, here of one
rank, are missing. Step: forward, backward and ts.optim.RowSparseSGD (momentum
0.9, weight decay 5e-4) on the weight, as in margin.py; one warm-up step, then
``--iters`` timed steps (median printed), then one profiled step.

    python benchmarks/margin_profile.py [--classes 500000] [--rows 256] [--features 512]
        [--rate 1.0] [--precision float32|bf16] [--iters 2] [--top 15] [--shapes]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SCALE, MARGIN = 64.0, 0.5


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=500_000)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--precision", choices=("float32", "bf16"), default="float32")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--shapes", action="store_true", help="group the ops by their input shapes too")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import shardtorch as ts

    torch.set_num_threads(1)
    common.world_of_one("margin-profile-")
    torch.manual_seed(0)
    loss_fn = ts.nn.ParallelMarginLoss(args.features, args.classes, SCALE, (1.0, MARGIN, 0.0), seed=1,
                                       sample_rate=args.rate)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(args.rows, args.features, generator=g).requires_grad_()
    target = torch.randint(0, args.classes, (args.rows,), generator=g)
    opt = ts.optim.RowSparseSGD([loss_fn.weight], lr=0.1, momentum=0.9, weight_decay=5e-4)

    def step():
        loss_fn.weight.grad = None
        x.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=args.precision == "bf16"):
            loss = loss_fn(x, target)
        loss.backward()
        opt.step()
        return loss.item()

    step()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
        step()
    print(f"### One rank's margin step: {args.classes} classes, {args.rows} rows, features {args.features}, "
          f"rate {args.rate}, {args.precision}; 1 thread; {common.cpu_name()}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"step: median {statistics.median(times) * 1e3:.0f} ms of {args.iters} "
          f"({', '.join(f'{t * 1e3:.0f}' for t in times)})")
    print(prof.key_averages(group_by_input_shape=args.shapes).table(sort_by="self_cpu_time_total",
                                                                    row_limit=args.top))
    ts.distributed.destroy_process_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
