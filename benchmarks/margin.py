"""Margin softmax (ArcFace) over a class-sharded weight, side by side:

  shardtorch margin, rate R    ts.nn.ParallelMarginLoss(sample_rate=R): the fused
                               chunked op, logits never materialised; with R < 1
                               only the kept rows are computed, the weight gradient
                               is row-sparse
  PartialFC-style, rate R      a reference written here the way insightface's
                               partial_fc_v2 works: class-sharded weight, kept rows
                               indexed out (autograd through the index: a dense
                               weight gradient), cosine logits of the kept classes
                               materialised, the margin applied on them, and a
                               distributed softmax cross-entropy (all-reduce of the
                               row max, of the sum of exponentials and of the target
                               probability; gradient softmax - one-hot)

Per rank: median step time (forward + backward, the methods interleaved) and
the peak of tensor memory allocated during the step beyond its inputs
(gradients included), measured with common.peak_memory (exact CPU allocator
accounting). All methods train the same weight tensor (one copy per rank), so
that 1M classes fit a small machine.

    python benchmarks/margin.py [--classes 100000,1000000] [--batch 128]
        [--features 512] [--rates 1.0,0.1] [--iters 3] [--out benchmarks]
        [--autocast bfloat16]

--autocast runs every method's step under torch.autocast("cpu", dtype) (the
margin loss then runs its GEMMs in that dtype with float32 accumulation).

It launches its own ranks (2 by default).
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REPO = common.REPO
SCALE, MARGIN = 64.0, 0.5


def _partial_fc_style(weight, classes, offset, rate, seed):
    """A PartialFC-style ArcFace step over this rank's rows ``weight``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    local = weight.shape[0]
    keep = min(local, math.ceil(rate * local))
    generator = torch.Generator().manual_seed(seed)
    cos_m, sin_m = math.cos(MARGIN), math.sin(MARGIN)
    threshold, fallback = math.cos(math.pi - MARGIN), math.sin(math.pi - MARGIN) * MARGIN

    class DistributedSoftmaxCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, column):
            row_max = logits.max(1, keepdim=True).values
            dist.all_reduce(row_max, dist.ReduceOp.MAX)
            probs = (logits - row_max).exp()
            total = probs.sum(1, keepdim=True)
            dist.all_reduce(total)
            probs.div_(total)
            here = column >= 0
            target_prob = torch.where(here, probs.gather(1, column.clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
            dist.all_reduce(target_prob)
            ctx.save_for_backward(probs, column)
            return -target_prob.clamp_min(1e-30).log().mean()

        @staticmethod
        def backward(ctx, grad):
            probs, column = ctx.saved_tensors
            here = (column >= 0).nonzero().squeeze(1)
            grad_logits = probs.clone()
            grad_logits[here, column[here]] -= 1.0
            return grad_logits * (grad / probs.shape[0]), None

    def step(x, target):
        mine = target[(target >= offset) & (target < offset + local)] - offset
        positives = torch.unique(mine)
        if rate < 1.0 and positives.numel() < keep:
            score = torch.rand(local, generator=generator)
            score[positives] = 2.0
            index = score.topk(keep).indices.sort().values
            rows = weight[index]
            column = torch.searchsorted(index, target - offset)
            column = torch.where((target >= offset) & (target < offset + local), column, -1)
        else:
            rows = weight
            column = torch.where((target >= offset) & (target < offset + local), target - offset, -1)
        logits = F.linear(F.normalize(x), F.normalize(rows)).clamp(-1, 1)
        here = (column >= 0).nonzero().squeeze(1)
        cos_t = logits[here, column[here]]
        sin_t = (1.0 - cos_t * cos_t).sqrt()
        margined = torch.where(cos_t > threshold, cos_t * cos_m - sin_t * sin_m, cos_t - fallback)
        logits = logits.index_put((here, column[here]), margined) * SCALE
        DistributedSoftmaxCrossEntropy.apply(logits, column).backward()

    return step


def _rank_main(args):
    import torch
    import torch.distributed as dist

    import shardtorch as ts

    torch.set_num_threads(1)
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
    size, rank = ts.distributed.get_group_size(), ts.distributed.get_group_rank()

    def peak_of(fn):
        dist.barrier()
        with common.peak_memory("cpu") as peak:
            fn()
        return peak.peak_bytes

    results = []
    amp = torch.autocast("cpu", dtype=getattr(torch, args.autocast or "bfloat16"), enabled=bool(args.autocast))
    for classes in args.classes:
        offset = ts._C.shard_offset(classes, size, rank)
        torch.manual_seed(0)
        # One module (one weight) for every rate: the rate is a plain attribute.
        loss_fn = ts.nn.ParallelMarginLoss(args.features, classes, SCALE, (1.0, MARGIN, 0.0), seed=1)
        weight = loss_fn.weight
        g = torch.Generator().manual_seed(2)
        x = torch.randn(args.batch, args.features, generator=g)
        target = torch.randint(0, classes, (args.batch,), generator=g)
        x_leaf = x.clone().requires_grad_()

        def reset():
            weight.grad = None
            x_leaf.grad = None

        methods = {}
        for rate in args.rates:
            def ours(rate=rate):
                loss_fn.sample_rate = rate
                loss_fn(x_leaf, target).backward()
                reset()

            reference = _partial_fc_style(weight, classes, offset, rate, seed=3)

            def theirs(reference=reference):
                reference(x_leaf, target)
                reset()
            methods[f"shardtorch margin, rate {rate}"] = ours
            methods[f"PartialFC-style, rate {rate}"] = theirs
        dist.barrier()
        with amp:
            seconds = common.time_interleaved(methods, args.iters, warmup=1)
            for name, fn in methods.items():
                results.append({"classes": classes, "method": name, "seconds": seconds[name],
                                "peak_bytes": peak_of(fn)})
        del loss_fn, weight, methods
    common.write_result(results)
    ts.distributed.destroy_process_group()


def _report(args, results):
    os.makedirs(args.out, exist_ok=True)
    mib = 1024 * 1024
    lines = [f"### ArcFace margin loss, {args.world_size} CPU ranks (Gloo, 1 thread each), batch {args.batch}, "
             f"embedding {args.features}"
             + (f", under autocast {args.autocast}" if args.autocast else ""), "",
             "| classes | method | step (ms) | vs PartialFC-style same rate | peak extra MiB per rank |",
             "|---:|---|---:|---:|---:|"]
    by = {(r["classes"], r["method"]): r for r in results}
    for r in results:
        rate = r["method"].split("rate ")[1]
        base = by[(r["classes"], f"PartialFC-style, rate {rate}")]["seconds"]
        lines.append(f"| {r['classes']:,} | {r['method']} | {r['seconds'] * 1e3:.1f} | "
                     f"{r['seconds'] / base:.2f} | {r['peak_bytes'] / mib:.1f} |")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in results):
        pts = [(r["classes"], r["seconds"] * 1e3, r["peak_bytes"] / mib) for r in results if r["method"] == method]
        ax_time.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax_mem.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=method)
    for ax, label in ((ax_time, "step ms (forward + backward)"), (ax_mem, "peak extra MiB per rank")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"classes (total, over {args.world_size} ranks)")
        ax.set_ylabel(label)
    ax_mem.legend(fontsize=7)
    fig.suptitle(f"ArcFace loss, batch {args.batch}, embedding {args.features}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "margin.png"), dpi=120)
    with open(os.path.join(args.out, "margin_results.json"), "w") as f:
        json.dump(results, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--classes", type=ints, default=[100_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 0.1])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks"))
    parser.add_argument("--autocast", choices=["bfloat16", "float16"], default=None,
                        help="run the steps under torch.autocast('cpu', dtype)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _rank_main(args)
        return
    ranks = common.launch(os.path.abspath(__file__), args.world_size, sys.argv[1:] + ["--worker"])
    _report(args, ranks[0])


if __name__ == "__main__":
    main()
