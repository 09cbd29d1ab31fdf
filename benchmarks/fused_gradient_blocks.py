"""The fused loss's gradients in forward against its recomputing self, in one
process (a world of one, 1 thread), for shapes chosen to land on either side of
the row-block threshold (docs/parallel_cross_entropy.md#cost):

  gradients in forward   _parallel_linear_cross_entropy_forward_with_gradients
  logits recomputed      _parallel_linear_cross_entropy_forward, then _backward
  unfused                F.cross_entropy(x @ w.T) and its backward

    python benchmarks/fused_gradient_blocks.py [--shapes 1024x12500,1024x50000] [--features 256]
        [--iters 5]

Prints, per shape (rows x classes), the rows per block that 2^22 elements allow and the median
step times, the three interleaved step by step; read the ratios.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import shardtorch as ts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="64x50000,1024x12500,1024x20000,1024x32000,512x40000,1024x50000")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    common.world_of_one()
    torch.set_num_threads(1)
    ops = torch.ops.shard
    print("| rows | classes | rows per block (2^22 / classes) | in forward ms | recomputed ms | unfused ms "
          "| in forward / recomputed | in forward / unfused |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        rows, classes = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, args.features)
        w = torch.randn(classes, args.features) * 0.05
        t = torch.randint(0, classes, (rows,))
        opts = (None, -100, 0.0, 0.0, 1, 4096, "tp")

        def in_forward():
            ops._parallel_linear_cross_entropy_forward_with_gradients(x, w, None, t, *opts, None,
                                                                      [True, True, False])

        def recomputed():
            _, stats = ops._parallel_linear_cross_entropy_forward(x, w, None, t, *opts, None)
            ops._parallel_linear_cross_entropy_backward(torch.ones(()), x, w, None, stats, t, *opts,
                                                        [True, True, False])

        def unfused():
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            torch.nn.functional.cross_entropy(xl @ wl.t(), t).backward()

        times = {"in": [], "re": [], "un": []}
        for _ in range(args.iters):
            for name, fn in (("in", in_forward), ("re", recomputed), ("un", unfused)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        m = {k: statistics.median(v) * 1000 for k, v in times.items()}
        print(f"| {rows} | {classes} | {(1 << 22) // classes} | {m['in']:.1f} | {m['re']:.1f} | {m['un']:.1f} "
              f"| {m['in'] / m['re']:.2f} | {m['in'] / m['un']:.2f} |", flush=True)
    ts.distributed.destroy_process_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
