"""A full ArcFace training step of the class-sharded head, shardtorch against
insightface's own PartialFC_V2, with the GEMM floor beside each row (issue 25).

Per rank: ``--batch`` rows of embeddings (2 ranks of 128 by default; both heads
see the ranks' rows gathered, 256, as PartialFC_V2 does), ``--features`` 512,
ArcFace s=64 m=0.5, one thread per rank, Gloo. One step = forward, backward and
the optimizer's step on the head's weight, SGD momentum 0.9 weight decay 5e-4
(insightface's train_v2):

  shardtorch     ts.nn.ParallelMarginLoss(sample_rate=R) on the gathered rows
                 (ts.distributed.gather_replicated, dim 0), trained with
                 ts.optim.RowSparseSGD (row-sparse weight gradient when R < 1)
  insightface    recognition/arcface_torch/partial_fc_v2.py (PartialFC_V2) with
                 losses.py's CombinedMarginLoss(64, 1.0, 0.5, 0.0), imported at
                 run time from a copy of insightface (``--insightface``: a
                 checkout or a bare git repository, whose HEAD files are read
                 into a temporary directory; never copied into this project),
                 trained with torch.optim.SGD as train_v2 builds it. Its CUDA
                 calls are mapped to the CPU in the rank processes, without
                 editing its files: Tensor.cuda() returns the tensor, and
                 torch.cuda.amp.autocast(enabled) is torch.autocast("cpu",
                 torch.bfloat16, enabled)
  PartialFC-style the fallback when no copy is given (labelled so): a head
                 written here the way partial_fc_v2 works (below)

Precisions: float32, and "bf16 autocast": shardtorch's forward under
torch.autocast("cpu", torch.bfloat16); insightface built with fp16=True (its
head's own autocast block, mapped as above; note train_v2 itself passes
fp16=False to PartialFC_V2). Weights and optimizer state stay float32.

Figures: the median of the steps after the first (``--iters`` of them), one head
after the other within a row; both train one shared weight tensor, each with its
own optimizer, one optimizer alive at a time, so that 1M classes fit a small
machine. The
step-0 losses of both heads on the same weight and inputs are printed (forward
only): at rate 1.0 they must agree; at rate < 1 the kept classes differ
(different samplers), so do the losses.

Floor: the raw GEMMs the head must do per rank at the same shapes and dtype, on
the same thread count, both ranks at once, into outputs allocated before: logits [B x F] x [F x K], the input
gradient [B x K] x [K x F] and the weight gradient [K x B] x [B x F], with
B = world x batch, K = this rank's kept classes (ceil(R x local)); in the bf16
rows the faster of float32 and bfloat16 operands and output (float32
accumulation inside: what autocast gives on the CPU, torch having no CPU kernel
for a float32-output bfloat16 mm), since under autocast shardtorch's heads run
their CPU GEMMs in bfloat16 only where the CPU has bfloat16 instructions (AMX,
AVX512-BF16) and in float32 elsewhere, where the emulated bfloat16 GEMM is the
slower (docs/cuda.md, Autocast; SHARDTORCH_CPU_AUTOCAST_GEMMS=reduced asks for
bfloat16 anyway). Both are in the JSON. The float32 GEMMs run as the heads run
theirs (torch.ops.shard._cpu_gemm_, csrc/ops/cpu/cpu_gemm.h: oneDNN where MKL's
sgemm runs narrower than the CPU, e.g. AMD's AVX-512 EPYCs; ATen's mm
elsewhere), so that the floor is the fastest float32 GEMM this build has here,
not MKL's AVX2 kernels. "step / floor" says how far a step is from that limit.

Optimizer alone: benchmarks/optimizer.py's measurement (RowSparseSGD.step
against torch.optim.SGD(foreach=True), dense gradient and ``--kept`` of the
rows) on one rank's weight shape, one thread, after the ranks finish.

    python benchmarks/margin.py --insightface PATH [--classes 20000,1000000]
        [--batch 128] [--features 512] [--rates 0.1,1.0] [--precisions float32,bf16]
        [--iters 3] [--json benchmarks/margin_step_results.json]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REPO = common.REPO
SCALE, MARGIN = 64.0, 0.5
SGD_SETTINGS = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)
INSIGHTFACE_FILES = ("recognition/arcface_torch/partial_fc_v2.py", "recognition/arcface_torch/losses.py")


def read_insightface(path, into):
    """Copies insightface's head files from ``path`` (a checkout, or a bare git
    repository: its HEAD) into the directory ``into``; returns a description of
    the source, or None when ``path`` holds neither."""
    if all(os.path.isfile(os.path.join(path, f)) for f in INSIGHTFACE_FILES):
        for f in INSIGHTFACE_FILES:
            with open(os.path.join(path, f)) as src, open(os.path.join(into, os.path.basename(f)), "w") as dst:
                dst.write(src.read())
        return f"checkout {path}"
    try:
        commit = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], check=True, capture_output=True,
                                text=True).stdout.strip()
        for f in INSIGHTFACE_FILES:
            text = subprocess.run(["git", "-C", path, "show", f"{commit}:{f}"], check=True, capture_output=True,
                                  text=True).stdout
            with open(os.path.join(into, os.path.basename(f)), "w") as dst:
                dst.write(text)
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"git {path} at {commit}"


def _map_cuda_to_cpu():
    """What insightface's head calls on CUDA, on the CPU (this rank process only)."""
    import torch

    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    def cpu_autocast(enabled=True, dtype=None, cache_enabled=True):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled, cache_enabled=cache_enabled)
    torch.cuda.amp.autocast = cpu_autocast


def _partial_fc_style(weight, offset, rate, seed, bf16):
    """The fallback reference: a PartialFC-style ArcFace forward + backward on
    this rank's rows ``weight`` (kept rows indexed out, so a dense gradient;
    cosine logits of the kept classes materialised, the margin applied on them,
    a distributed softmax cross-entropy)."""
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

    def loss(x, target):
        mine = target[(target >= offset) & (target < offset + local)] - offset
        positives = torch.unique(mine)
        inside = (target >= offset) & (target < offset + local)
        if rate < 1.0 and positives.numel() < keep:
            score = torch.rand(local, generator=generator)
            score[positives] = 2.0
            index = score.topk(keep).indices.sort().values
            rows = weight[index]
            column = torch.where(inside, torch.searchsorted(index, target - offset), -1)
        else:
            rows = weight
            column = torch.where(inside, target - offset, -1)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = F.linear(F.normalize(x), F.normalize(rows))
        logits = logits.float().clamp(-1, 1)
        here = (column >= 0).nonzero().squeeze(1)
        cos_t = logits[here, column[here]]
        sin_t = (1.0 - cos_t * cos_t).sqrt()
        margined = torch.where(cos_t > threshold, cos_t * cos_m - sin_t * sin_m, cos_t - fallback)
        logits = logits.index_put((here, column[here]), margined) * SCALE
        return DistributedSoftmaxCrossEntropy.apply(logits, column)

    return loss


def _gemm_floor(batch, features, kept, bf16, iters):
    """Median seconds of the head's three GEMMs at these shapes (see the module doc)."""
    import torch

    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(batch, features, generator=g).to(dtype)
    w = torch.randn(kept, features, generator=g).to(dtype)
    grad = torch.randn(batch, kept, generator=g).to(dtype)
    # Into outputs written before: the GEMMs alone, without the page faults of
    # fresh outputs (which a head can avoid: ops/scratch_buffer.h).
    logits, grad_x, grad_w = torch.mm(x, w.t()), torch.mm(grad, w), torch.mm(grad.t(), x)
    # float32: the library the heads' GEMMs take (cpu_gemm.h); bfloat16: ATen's (oneDNN).
    mm_out = (lambda out, a, b: torch.ops.shard._cpu_gemm_(out, a, b)) if not bf16 else \
        (lambda out, a, b: torch.mm(a, b, out=out))

    def three():
        mm_out(logits, x, w.t())
        mm_out(grad_x, grad, w)
        mm_out(grad_w, grad.t(), x)
    three()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        three()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank_main(args):
    import torch
    import torch.distributed as dist

    import shardtorch as ts

    torch.set_num_threads(1)
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
    size, rank = ts.distributed.get_group_size(), ts.distributed.get_group_rank()
    insightface = None
    if args.insightface_src:
        _map_cuda_to_cpu()
        sys.path.insert(0, args.insightface_src)
        import losses
        import partial_fc_v2
        insightface = (partial_fc_v2.PartialFC_V2, losses.CombinedMarginLoss)
    theirs_name = "insightface" if insightface else "PartialFC-style (fallback)"

    results = []
    for classes in args.classes:
        offset = ts._C.shard_offset(classes, size, rank)
        torch.manual_seed(0)
        loss_fn = ts.nn.ParallelMarginLoss(args.features, classes, SCALE, (1.0, MARGIN, 0.0), seed=1)
        weight = loss_fn.weight
        local = weight.shape[0]
        g = torch.Generator().manual_seed(2)
        x_all = torch.randn(size * args.batch, args.features, generator=g)
        target_all = torch.randint(0, classes, (size * args.batch,), generator=g)
        x_mine = x_all[rank * args.batch:(rank + 1) * args.batch].clone().requires_grad_()
        target_mine = target_all[rank * args.batch:(rank + 1) * args.batch]

        rows = []  # (rate, precision, our loss, their loss): the closures first, so that the
        for rate in args.rates:  # step-0 losses are all taken on the initial weight
            heads = {}
            if insightface:
                pfc_cls, margin_cls = insightface
                for bf16 in (False, True):
                    head = pfc_cls(margin_cls(SCALE, 1.0, MARGIN, 0.0), args.features, classes, rate, fp16=bf16)
                    assert (head.num_local, head.class_start) == (local, offset), "shards differ"
                    head.weight = weight  # one weight tensor for both heads
                    heads[bf16] = head
            for precision in args.precisions:
                bf16 = precision == "bf16"

                def ours_loss(rate=rate, bf16=bf16):
                    loss_fn.sample_rate = rate
                    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                        return loss_fn(ts.distributed.gather_replicated(x_mine, dim=0), target_all)

                if insightface:
                    def theirs_loss(head=heads[bf16]):
                        # PartialFC_V2 writes into its labels (squeeze_): a fresh copy each step.
                        return head(x_mine, target_mine.clone())
                else:
                    reference = _partial_fc_style(weight, offset, rate, seed=3, bf16=bf16)

                    def theirs_loss(reference=reference):
                        return reference(torch.cat(dist_all_gather(x_mine)), target_all)
                rows.append((rate, precision, ours_loss, theirs_loss))
        step0 = []
        with torch.no_grad():
            for rate, precision, ours_loss, theirs_loss in rows:
                step0.append({"shardtorch": ours_loss().item(), theirs_name: theirs_loss().item()})

        for (rate, precision, ours_loss, theirs_loss), losses_at_start in zip(rows, step0):
            bf16 = precision == "bf16"
            seconds = {}
            for name, make_loss, make_optimizer in (
                    ("shardtorch", ours_loss, lambda: ts.optim.RowSparseSGD([weight], **SGD_SETTINGS)),
                    (theirs_name, theirs_loss, lambda: torch.optim.SGD([weight], **SGD_SETTINGS))):
                # One optimizer (one momentum buffer as large as the weight) alive at a time.
                opt = make_optimizer()

                def step():
                    weight.grad = None
                    x_mine.grad = None
                    make_loss().backward()
                    opt.step()
                dist.barrier()
                seconds.update(common.time_interleaved({name: step}, args.iters, warmup=1, sync=dist.barrier))
                weight.grad = None
                opt = step = None
            kept = local if rate >= 1.0 else min(local, math.ceil(rate * local))
            dist.barrier()
            floor = _gemm_floor(size * args.batch, args.features, kept, bf16, max(args.iters, 3))
            floors = {"bfloat16" if bf16 else "float32": floor}
            if bf16:
                # Under autocast the head may run its CPU GEMMs in float32 (where the CPU has no
                # bfloat16 instructions and float32 is faster): the floor is the faster of the two.
                floors["float32"] = _gemm_floor(size * args.batch, args.features, kept, False, max(args.iters, 3))
                floor = min(floors.values())
            results.append({"classes": classes, "rate": rate, "precision": precision, "kept_rows": kept,
                            "seconds": seconds, "floor_seconds": floor, "floors_by_dtype": floors,
                            "step0_loss": losses_at_start})
            print(f"rank {rank}: {classes} classes rate {rate} {precision}: "
                  + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in seconds.items())
                  + f", floor {floor * 1e3:.0f} ms, step-0 losses {losses_at_start}", flush=True)
        rows = loss_fn = weight = heads = None  # free this size's weight before the next
    common.write_result(results)
    ts.distributed.destroy_process_group()


def dist_all_gather(x):
    """The ranks' rows, differentiable (the fallback reference's gather)."""
    import torch.distributed.nn

    return torch.distributed.nn.all_gather(x)


def _optimizer_alone(args, local_rows):
    import torch

    import optimizer

    torch.set_num_threads(1)
    return optimizer.measure(local_rows, args.features, args.kept, [1], args.iters, kinds=("sgd",))


def _report(args, ranks, source, optim):
    results = ranks[0]
    theirs_name = "insightface" if source else "PartialFC-style (fallback)"
    lines = [f"### ArcFace training step (forward, backward, SGD step), {args.world_size} CPU ranks (Gloo, 1 thread "
             f"each), {args.batch} rows per rank, embedding {args.features}, median of {args.iters} steps after "
             f"the first; {common.cpu_name()}", "",
             f"{theirs_name}: {source or 'no insightface copy given (--insightface PATH)'}", "",
             f"| classes | rate | precision | {theirs_name} ms | shardtorch ms | ratio | GEMM floor ms "
             f"| shardtorch / floor | {theirs_name} / floor | step-0 loss shardtorch / {theirs_name} |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        # Each step ends at a barrier: the slower rank's time is the step's.
        theirs = max(rr_row[theirs_name] for rr_row in _seconds_of(ranks, r))
        ours = max(rr_row["shardtorch"] for rr_row in _seconds_of(ranks, r))
        # The floor is a least time: the faster rank's (the machine's noise only adds).
        floor = min(_row_of(rr, r)["floor_seconds"] for rr in ranks)
        l_ours, l_theirs = r["step0_loss"]["shardtorch"], r["step0_loss"][theirs_name]
        lines.append(f"| {r['classes']:,} | {r['rate']:g} | {r['precision']} | {theirs * 1e3:,.0f} | "
                     f"{ours * 1e3:,.0f} | {ours / theirs:.2f} | {floor * 1e3:,.0f} | {ours / floor:.1f} | "
                     f"{theirs / floor:.1f} | {l_ours:.5f} / {l_theirs:.5f} |")
    lines += ["", "Step-0 losses: same weight and inputs, forward only; at rate < 1 the two samplers keep "
              "different classes, so the losses differ.", ""]
    if optim:
        base = optim["ms"]["sgd threads=1"]
        lines += [f"Optimizer alone (benchmarks/optimizer.py's measurement), one [{optim['shape'][0]:,}, "
                  f"{optim['shape'][1]}] float32 weight shard, 1 thread, SGD momentum 0.9 wd 5e-4, median of "
                  f"{optim['repeats']}:", "", "| method | ms | vs torch dense |", "|---|---:|---:|"]
        lines += [f"| {name} | {ms:,.1f} | {ms / base['torch dense']:.2f} |" for name, ms in base.items()]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": common.cpu_name(), "reference": theirs_name, "source": source, "ranks": ranks,
                       "optimizer": optim, "argv": sys.argv[1:]}, f, indent=1)


def _row_of(rank_results, r):
    return next(x for x in rank_results if (x["classes"], x["rate"], x["precision"])
                == (r["classes"], r["rate"], r["precision"]))


def _seconds_of(ranks, r):
    return [_row_of(rr, r)["seconds"] for rr in ranks]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--classes", type=ints, default=[20_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",")], default=[0.1, 1.0])
    parser.add_argument("--precisions", type=lambda s: s.split(","), default=["float32", "bf16"])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--kept", type=float, default=0.1, help="the optimizer-alone row fraction")
    parser.add_argument("--insightface", default=os.environ.get("INSIGHTFACE"),
                        help="an insightface checkout or bare git repository (default $INSIGHTFACE)")
    parser.add_argument("--no-optimizer", action="store_true", help="skip the optimizer-alone measurement")
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "margin_step_results.json"))
    parser.add_argument("--report", metavar="JSON", help="print the tables of an earlier run's JSON, run nothing")
    parser.add_argument("--insightface-src", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _rank_main(args)
        return
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        args = parser.parse_args(saved["argv"])
        args.json = None
        _report(args, saved["ranks"], saved["source"], saved["optimizer"])
        return
    if any(p not in ("float32", "bf16") for p in args.precisions):
        parser.error(f"--precisions: float32 and/or bf16, got {args.precisions}")
    with tempfile.TemporaryDirectory() as src:
        source = read_insightface(args.insightface, src) if args.insightface else None
        if source is None:
            print(f"insightface: no copy at {args.insightface!r} (--insightface PATH: a checkout or a bare git "
                  f"repository); comparing with the PartialFC-style fallback written here", flush=True)
        worker_args = sys.argv[1:] + ["--worker"] + (["--insightface-src", src] if source else [])
        ranks = common.launch(os.path.abspath(__file__), args.world_size, worker_args)
    optim = None
    if not args.no_optimizer:
        local_rows = math.ceil(max(args.classes) / args.world_size)
        optim = _optimizer_alone(args, local_rows)
    _report(args, ranks, source, optim)


if __name__ == "__main__":
    main()
