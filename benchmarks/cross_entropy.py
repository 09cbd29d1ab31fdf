"""Parallel cross-entropy side by side on 2 CPU ranks (Gloo):

  shardtorch CE          torch.ops.shard.parallel_cross_entropy on a logits shard
  shardtorch linear+CE   ParallelLinear(dim=1) then the parallel loss
  shardtorch fused       parallel_linear_cross_entropy (logits never materialised)
  torch loss_parallel    F.cross_entropy on a DTensor sharded on classes, under
                         torch.distributed.tensor.parallel.loss_parallel()
  unsharded              F.cross_entropy on the whole logits (every rank)

Per rank: median step time (forward + backward) and the peak of bytes
allocated during the step beyond its inputs (gradients included: for the
linear variants that is the weight gradient, [local_classes, hidden]) (CPU allocator events from
torch.profiler, see _peak_extra_bytes), plus a sweep of that peak against the
class count at the largest batch.

    python benchmarks/cross_entropy.py [--classes 100000] [--batches 64,1024]
        [--hidden 256] [--iters 3] [--out benchmarks]

Without RANK in the environment it launches its own 2 ranks.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peak_extra_bytes(fn):
    """Running sum of the CPU allocator's alloc/free events while fn runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The raw allocator records: prof.events() folds those made inside an op
    # into the op's net usage, which hides the op's own peak.
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak


def _methods(batch, classes, hidden):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    import shardtorch as ts

    size, rank = ts.distributed.get_group_size(), ts.distributed.get_group_rank()
    local = ts._C.shard_size(classes, size, rank)
    offset = ts._C.shard_offset(classes, size, rank)
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, classes, (batch,), generator=g)
    shard = torch.randn(batch, local)
    x = torch.randn(batch, hidden)
    w = torch.randn(local, hidden) * 0.05
    mesh = init_device_mesh("cpu", (size,))

    # Inputs are leaves made once, outside the measured steps, so that a step
    # counts only what the loss itself allocates (gradients included).
    shard_leaf = shard.clone().requires_grad_()
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    full = torch.randn(batch, classes) if batch * classes <= 2 ** 28 else None
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
               "torch loss_parallel (DTensor)": dtensor_loss_parallel}
    if full is not None:
        methods["unsharded F.cross_entropy"] = unsharded
    return methods


def _rank_main(args):
    import torch
    import torch.distributed as dist

    import shardtorch as ts

    torch.set_num_threads(1)
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    results = {"steps": [], "sweep": []}
    for batch in args.batches:
        for name, fn in _methods(batch, args.classes, args.hidden).items():
            fn()  # warm-up
            dist.barrier()
            times = []
            for _ in range(args.iters):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            dist.barrier()
            peak = _peak_extra_bytes(fn)
            results["steps"].append({"batch": batch, "method": name,
                                     "seconds": statistics.median(times), "peak_bytes": peak})
    sweep_batch = max(args.batches)
    for classes in args.sweep:
        for name, fn in _methods(sweep_batch, classes, args.hidden).items():
            dist.barrier()
            results["sweep"].append({"classes": classes, "method": name,
                                     "peak_bytes": _peak_extra_bytes(fn)})
    with open(os.path.join(args.tmp, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    ts.distributed.destroy_process_group()


def _launch(args):
    with tempfile.TemporaryDirectory() as tmp:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=REPO)
            procs.append(subprocess.Popen([sys.executable, __file__, "--tmp", tmp] + sys.argv[1:],
                                          env=env))
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"a rank failed with {p.returncode}")
        with open(os.path.join(tmp, "rank0.json")) as f:
            return json.load(f)


def _report(args, results):
    mib = 1024 * 1024
    base = {(r["batch"]): r["seconds"] for r in results["steps"]
            if r["method"] == "torch loss_parallel (DTensor)"}
    lines = [f"### Parallel cross-entropy, 2 CPU ranks (Gloo, 1 thread each), {args.classes} classes, "
             f"hidden {args.hidden} for the linear variants", "",
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
    ax.set_xlabel("classes (total, over 2 ranks)")
    ax.set_ylabel("peak extra MiB per rank (forward + backward)")
    ax.set_title(f"Cross-entropy memory, batch {max(args.batches)}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "cross_entropy_memory.png"), dpi=120)
    with open(os.path.join(args.out, "cross_entropy_results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[64, 1024])
    parser.add_argument("--sweep", type=lambda s: [int(v) for v in s.split(",")],
                        default=[12_500, 25_000, 50_000, 100_000])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks"))
    parser.add_argument("--tmp", default=None)
    args = parser.parse_args()
    if "RANK" in os.environ:
        _rank_main(args)
    else:
        _report(args, _launch(args))


if __name__ == "__main__":
    main()
