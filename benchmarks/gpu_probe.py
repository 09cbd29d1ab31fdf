"""A short probe of the CUDA path on one GPU (tests/gpu/run.sh runs it; about a minute on an H200).

1. Cross-entropy on [2200, 1,000,003] bfloat16 logits (a world of one rank, so the parallel op runs
   whole) against float32 F.cross_entropy of the same logits: the loss and gradient differences,
   ms per forward + backward and max_memory_allocated of each.
2. ts.nn.ParallelMarginLoss(512, 1,000,000) at batch 4096, sample rates 0.1 and 1.0, RowSparseSGD:
   one warm-up step, then 3 timed steps (ms/step, max_memory_allocated), then one step under the
   profiler counting device-to-host synchronisations (cudaStreamSynchronize, cudaEventSynchronize,
   cudaDeviceSynchronize and device-to-host copies) and one under torch.cuda.set_sync_debug_mode, counting
   shardtorch's waits for its deferred argument checks too (shardtorch.utils.host_syncs).

    python benchmarks/gpu_probe.py [--out DIR] [--classes 1000003] [--rows 2200]

Writes DIR/gpu_probe.json and prints a summary table.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardtorch as ts
from shardtorch.utils.host_syncs import host_syncs, profiled_host_syncs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def world_of_one():
    common.world_of_one("shardtorch-probe-")


def timed(fn, steps):
    """(ms per call, max_memory_allocated in GiB) over ``steps`` calls after one warm-up."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated() / 2**30


def syncs_of(fn):
    """Host syncs of one call, each counter from one run (shardtorch.utils.host_syncs)."""
    profiled = profiled_host_syncs(fn)
    counted = host_syncs(fn)
    return {"profiler_sync_calls": profiled.sync_calls, "profiler_memcpy_dtoh": profiled.memcpy_dtoh,
            "sync_debug_mode": len(counted.debug_mode), "deferred_check_waits": counted.deferred_check_waits}


def probe_cross_entropy(rows, classes, steps):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(rows, classes, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, classes, (rows,), device="cuda", generator=g)
    ref_logits = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits, target)
    ref.backward()
    loss = ts.nn.functional.parallel_cross_entropy(logits, target)
    loss.backward()
    result = {"rows": rows, "classes": classes,
              "loss": loss.item(), "loss_float32_reference": ref.item(),
              "loss_abs_diff": abs(loss.item() - ref.item()),
              "grad_max_abs_diff": (logits.grad.float() - ref_logits.grad).abs().max().item(),
              "grad_max_abs_reference": ref_logits.grad.abs().max().item()}
    del ref_logits, ref

    def step_shardtorch():
        logits.grad = None
        ts.nn.functional.parallel_cross_entropy(logits, target).backward()

    def step_torch():
        x = logits.detach().float().requires_grad_()  # what a float32 loss needs: the cast is its cost
        F.cross_entropy(x, target).backward()

    result["shardtorch_ms"], result["shardtorch_peak_gib"] = timed(step_shardtorch, steps)
    result["torch_float32_ms"], result["torch_float32_peak_gib"] = timed(step_torch, steps)
    return result


def probe_margin(rate, batch, features, classes, steps):
    torch.manual_seed(0)
    loss_fn = ts.nn.ParallelMarginLoss(features, classes, sample_rate=rate, device="cuda")
    optimizer = ts.optim.RowSparseSGD(loss_fn.parameters(), lr=0.1, momentum=0.9)
    embeddings = torch.randn(batch, features, device="cuda").requires_grad_()
    target = torch.randint(0, classes, (batch,), device="cuda")

    def step():
        optimizer.zero_grad()
        embeddings.grad = None
        loss_fn(embeddings, target).backward()
        optimizer.step()

    ms, peak = timed(step, steps)
    result = {"rate": rate, "batch": batch, "features": features, "classes": classes, "ms_per_step": ms,
              "peak_gib": peak, "kept": int(loss_fn.last_sampled_classes.numel())}
    result.update(syncs_of(step))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--rows", type=int, default=2200)
    parser.add_argument("--classes", type=int, default=1_000_003)
    parser.add_argument("--margin-classes", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world_of_one()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cross_entropy": probe_cross_entropy(args.rows, args.classes, args.steps)}
    torch.cuda.empty_cache()
    results["margin"] = [probe_margin(rate, args.batch, args.features, args.margin_classes, args.steps)
                         for rate in (0.1, 1.0)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    ce = results["cross_entropy"]
    print(f"== probe on {results['device']}, torch {results['torch']}")
    print(f"cross-entropy [{ce['rows']}, {ce['classes']}] bf16 vs float32 F.cross_entropy: "
          f"|loss diff| {ce['loss_abs_diff']:.2e} (loss {ce['loss']:.5f}), max |grad diff| "
          f"{ce['grad_max_abs_diff']:.2e} (max |grad| {ce['grad_max_abs_reference']:.2e})")
    print(f"  shardtorch {ce['shardtorch_ms']:.1f} ms, peak {ce['shardtorch_peak_gib']:.2f} GiB; "
          f"torch float32 {ce['torch_float32_ms']:.1f} ms, peak {ce['torch_float32_peak_gib']:.2f} GiB")
    print("margin 512 x 1M, batch 4096: rate | kept | ms/step | peak GiB | syncs (profiler, DtoH copies, debug, "
          "deferred-check waits)")
    for m in results["margin"]:
        print(f"  {m['rate']:.1f} | {m['kept']} | {m['ms_per_step']:.1f} | {m['peak_gib']:.2f} | "
              f"{m['profiler_sync_calls']}, {m['profiler_memcpy_dtoh']}, {m['sync_debug_mode']}, "
              f"{m['deferred_check_waits']}")
    ts.distributed.destroy_process_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
