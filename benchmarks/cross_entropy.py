"""Parallel cross-entropy side by side:

  shardtorch CE          torch.ops.shard.parallel_cross_entropy on a logits shard
  shardtorch linear+CE   ParallelLinear(dim=1) then the parallel loss
  shardtorch fused       parallel_linear_cross_entropy (logits never materialised;
                         gradients computed in forward, backward scales them)
  shardtorch fused, chunk_size 16384
                         the same with a 4x larger chunk (and block) bound
  shardtorch fused, logits recomputed
                         its internal forward and backward ops: the logits
                         recomputed in backward (the fused loss before)
  torch loss_parallel    F.cross_entropy on a DTensor sharded on classes, under
                         torch.distributed.tensor.parallel.loss_parallel()
  unsharded              F.cross_entropy on the whole logits (every rank)

Per rank: median step time (forward + backward, the methods interleaved) and
the peak of tensor memory allocated during the step beyond its inputs
(gradients included: for the linear variants that is the weight gradient,
[local_classes, hidden]), measured with common.peak_memory (exact CPU
allocator accounting; the CUDA allocator's statistics on GPU); plus a sweep of
that peak against the class count at the largest batch.

    python benchmarks/cross_entropy.py [--classes 100000] [--batches 64,1024]
        [--hidden 256] [--iters 3] [--out benchmarks] [--autocast bfloat16]
    python benchmarks/cross_entropy.py --device cuda --world-size 1   # one rank per GPU (NCCL)

It launches its own ranks (2 by default).
"""
import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REPO = common.REPO


def _methods(batch, classes, hidden, device):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    import shardtorch as ts

    size, rank = ts.distributed.get_group_size(), ts.distributed.get_group_rank()
    local = ts._C.shard_size(classes, size, rank)
    offset = ts._C.shard_offset(classes, size, rank)
    g = torch.Generator(device=device).manual_seed(0)
    target = torch.randint(0, classes, (batch,), generator=g, device=device)
    shard = torch.randn(batch, local, generator=g, device=device)
    x = torch.randn(batch, hidden, generator=g, device=device)
    w = torch.randn(local, hidden, generator=g, device=device) * 0.05
    mesh = init_device_mesh(device, (size,))

    # Inputs are leaves made once, outside the measured steps, so that a step
    # counts only what the loss itself allocates (gradients included).
    shard_leaf = shard.clone().requires_grad_()
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    full = torch.randn(batch, classes, device=device) if batch * classes <= 2 ** 28 else None
    full_leaf = full.requires_grad_() if full is not None else None

    def reset(*leaves):
        for leaf in leaves:
            leaf.grad = None

    def st_ce():
        torch.ops.shard.parallel_cross_entropy(shard_leaf, target, None, -100, 0.0, 0.0, 1, "tp",
                                               classes).backward()
        reset(shard_leaf)

    def st_linear_ce():
        logits = torch.ops.shard.parallel_linear(x_leaf, w_leaf, None, 1, "tp")
        torch.ops.shard.parallel_cross_entropy(logits, target, None, -100, 0.0, 0.0, 1, "tp",
                                               classes).backward()
        reset(x_leaf, w_leaf)

    def st_fused():
        torch.ops.shard.parallel_linear_cross_entropy(x_leaf, w_leaf, None, target, None, -100,
                                                      0.0, 0.0, 1, 4096, "tp", classes).backward()
        reset(x_leaf, w_leaf)

    def st_fused_wide_chunks():
        # A larger chunk_size raises the block bound (rows x chunk_size): at
        # batch 1024 over 50,000 classes, blocks of 335 rows instead of the
        # default's 83, whose logits are then computed once.
        torch.ops.shard.parallel_linear_cross_entropy(x_leaf, w_leaf, None, target, None, -100,
                                                      0.0, 0.0, 1, 16384, "tp", classes).backward()
        reset(x_leaf, w_leaf)

    def st_fused_recomputed():
        # The fused loss as it was before it computed its gradients in
        # forward: its internal forward, then a backward recomputing the logits.
        xd, wd = x_leaf.detach(), w_leaf.detach()
        _, stats = torch.ops.shard._parallel_linear_cross_entropy_forward(
            xd, wd, None, target, None, -100, 0.0, 0.0, 1, 4096, "tp", classes)
        torch.ops.shard._parallel_linear_cross_entropy_backward(
            torch.ones((), device=device), xd, wd, None, stats, target, None, -100, 0.0, 0.0, 1,
            4096, "tp", [True, True, False])

    def dtensor_loss_parallel():
        dt = DTensor.from_local(shard_leaf, mesh, [Shard(1)], run_check=False,
                                shape=torch.Size([batch, classes]), stride=(classes, 1))
        with loss_parallel():
            F.cross_entropy(dt, target).backward()
        reset(shard_leaf)

    def unsharded():
        F.cross_entropy(full_leaf, target).backward()
        reset(full_leaf)

    del offset
    methods = {"shardtorch CE": st_ce, "shardtorch linear+CE": st_linear_ce,
               "shardtorch fused linear+CE": st_fused,
               "shardtorch fused, chunk_size 16384": st_fused_wide_chunks,
               "shardtorch fused, logits recomputed": st_fused_recomputed,
               "torch loss_parallel (DTensor)": dtensor_loss_parallel}
    if full is not None:
        methods["unsharded F.cross_entropy"] = unsharded
    return methods


def _rank_main(args):
    import torch
    import torch.distributed as dist

    import shardtorch as ts

    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))

    def peak_of(fn):
        dist.barrier()
        with common.peak_memory(args.device) as peak:
            fn()
        return peak.peak_bytes

    def release(methods):
        # Each set holds its inputs (at batch 4096 over 1M classes, tens of
        # GiB): free it before the next is made, or two sets overflow one GPU.
        methods.clear()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

    results = {"steps": [], "sweep": []}
    # --autocast: every method's step under torch.autocast (the fused loss
    # then runs its GEMMs in that dtype with float32 accumulation).
    amp = torch.autocast(args.device, dtype=getattr(torch, args.autocast or "bfloat16"),
                         enabled=bool(args.autocast))
    for batch in args.batches:
        methods = _methods(batch, args.classes, args.hidden, args.device)
        dist.barrier()
        with amp:
            seconds = common.time_interleaved(methods, args.iters, warmup=1, sync=sync)
            for name, fn in methods.items():
                results["steps"].append({"batch": batch, "method": name, "seconds": seconds[name],
                                         "peak_bytes": peak_of(fn)})
        del fn  # the loop variable would keep the last method's inputs alive
        release(methods)
    sweep_batch = max(args.batches)
    for classes in args.sweep:
        methods = _methods(sweep_batch, classes, args.hidden, args.device)
        for name, fn in methods.items():
            results["sweep"].append({"classes": classes, "method": name, "peak_bytes": peak_of(fn)})
        del fn
        release(methods)
    if args.device == "cuda":
        results["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    common.write_result(results)
    ts.distributed.destroy_process_group()


def _report(args, results):
    mib = 1024 * 1024
    os.makedirs(args.out, exist_ok=True)
    base = {(r["batch"]): r["seconds"] for r in results["steps"]
            if r["method"] == "torch loss_parallel (DTensor)"}
    where = ("CPU ranks (Gloo, 1 thread each)" if args.device == "cpu" else "GPUs (NCCL)")
    lines = [f"### Parallel cross-entropy, {args.world_size} {where}, {args.classes} classes, "
             f"hidden {args.hidden} for the linear variants"
             + (f", under autocast {args.autocast}" if args.autocast else ""), "",
             "| batch | method | step (ms) | vs loss_parallel | peak extra MiB per rank |",
             "|---:|---|---:|---:|---:|"]
    for r in results["steps"]:
        lines.append(f"| {r['batch']} | {r['method']} | {r['seconds'] * 1e3:.1f} | "
                     f"{r['seconds'] / base[r['batch']]:.2f} | {r['peak_bytes'] / mib:.1f} |")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in results["sweep"]):
        pts = [(r["classes"], r["peak_bytes"] / mib) for r in results["sweep"] if r["method"] == method]
        ax.plot(*zip(*pts), marker="o", label=method)
    ax.set_xlabel(f"classes (total, over {args.world_size} ranks)")
    ax.set_ylabel("peak extra MiB per rank (forward + backward)")
    ax.set_title(f"Cross-entropy memory, batch {max(args.batches)}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    fig.savefig(os.path.join(args.out, f"cross_entropy_memory{suffix}.png"), dpi=120)
    with open(os.path.join(args.out, f"cross_entropy_results{suffix}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[64, 1024])
    parser.add_argument("--sweep", type=lambda s: [int(v) for v in s.split(",")],
                        default=[12_500, 25_000, 50_000, 100_000])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks"))
    parser.add_argument("--autocast", choices=["bfloat16", "float16"], default=None,
                        help="run the timed steps under torch.autocast(device, dtype)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _rank_main(args)
        return
    argv = [a for a in sys.argv[1:]] + ["--worker"]
    ranks = common.launch(os.path.abspath(__file__), args.world_size, argv)
    _report(args, ranks[0])


if __name__ == "__main__":
    main()
