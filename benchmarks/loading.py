"""Loading a Hugging Face checkpoint onto N tensor-parallel ranks: peak memory
and time per rank, shardtorch against transformers' own tensor parallelism.

    python benchmarks/loading.py                      # 2 and 4 ranks, two interleaved rounds
    python benchmarks/loading.py --ranks 2 --rounds 1

The checkpoint: a Llama-style model (18 layers, width 1024, 16 query / 8
key-value heads, MLP 2816, vocabulary 32,000, untied head) saved with
save_pretrained in float32 (1.03 GiB in one model.safetensors), made once
under benchmarks/out/. Each way of loading runs in fresh processes (torchrun's
environment, Gloo), one after the other, round-robin over the rounds:
- shardtorch: ``ts.nn.from_pretrained(path)``, the default: the proof on a
  miniature of the class is run by the first load and kept (under a folder of
  the benchmark's own, emptied when it starts), later loads check its key
  (shardtorch/nn/whole_model/proof_cache.py); its round 0 is the first load;
- shardtorch proving: the same with ``SHARDTORCH_PROOF_CACHE=0`` (the proof
  on a miniature run by every load);
- shardtorch unproven: ``ts.nn.from_pretrained(path, verify=False)`` (the
  ways above against this one: what the proof costs);
- transformers: ``AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")``;
- whole, then parallelize: ``from_pretrained(path)`` then ``ts.nn.parallelize``.
Per rank: resident memory after the imports and the process group (the
baseline), the kernel's high-water mark of resident memory while loading
(VmHWM, reset after the baseline: every byte the process touched), the bytes
of the parameters it keeps, and the load's wall time; then the loss of one
fixed batch, which must agree across the ways (all load the same model), its
time (the process's first forward: where a proof ran, its warm-up is paid), and
the resident memory after it: shardtorch and transformers both leave some
parameters as maps of the file that are read when first touched, so the
forward's figure shows what each holds once every weight has been used.
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=18,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False)
WAYS = ("shardtorch", "shardtorch-proving", "shardtorch-unproven", "transformers", "whole+parallelize")


def _time_the_proof():
    """The seconds parallelize spends on the proof (its key checked, the miniature built and proven)."""
    from shardtorch.nn.whole_model import apply
    return common.time_spent_in(apply, "_proven_before", "prove_on_miniature")


def rank_job(way, path):
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import shardtorch as ts
    AutoConfig.from_pretrained(path)  # its lazy imports (accelerate, kernels, ...: 170 MiB) belong to the baseline
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if way != "transformers":
        ts.distributed.init_process_group(group_size=world)
    proof_seconds = _time_the_proof() if way.startswith("shardtorch") else [0.0]
    dist.barrier()
    baseline = common.reset_peak_resident_memory()
    start = time.perf_counter()
    if way in ("shardtorch", "shardtorch-proving"):
        os.environ["SHARDTORCH_PROOF_CACHE"] = "0" if way == "shardtorch-proving" else "1"
        model = ts.nn.from_pretrained(path)
    elif way == "shardtorch-unproven":
        model = ts.nn.from_pretrained(path, verify=False)
    elif way == "transformers":
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    else:
        model = ts.nn.parallelize(AutoModelForCausalLM.from_pretrained(path))
    seconds = time.perf_counter() - start
    peak = common.status_kib("VmHWM")
    local = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    forward_seconds = time.perf_counter() - start  # the process's first forward (a proof has run one before)
    used = common.status_kib("VmRSS")
    common.write_result({"way": way, "rank": dist.get_rank(), "seconds": seconds, "baseline_mib": baseline / 1024,
                         "peak_mib": peak / 1024, "peak_above_baseline_mib": (peak - baseline) / 1024,
                         "after_forward_above_baseline_mib": (used - baseline) / 1024,
                         "local_parameter_mib": local / 2**20, "loss": loss, "proof_seconds": proof_seconds[0],
                         "first_forward_seconds": forward_seconds})
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4", help="world sizes (default: 2,4)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"which loaders (default: {','.join(WAYS)})")
    parser.add_argument("--checkpoint", default=os.path.join(common.REPO, "benchmarks", "out", "llama-1gib"))
    parser.add_argument("--json", default=None, help="write every rank's figures to this file")
    parser.add_argument("--rank-job", nargs=2, metavar=("WAY", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        return rank_job(*args.rank_job)
    common.llama_checkpoint(args.checkpoint, CONFIG)
    proofs = os.path.join(common.REPO, "benchmarks", "out", "loading-proofs")
    shutil.rmtree(proofs, ignore_errors=True)
    os.environ["SHARDTORCH_CACHE_DIR"] = proofs  # the ranks inherit it
    size = os.path.getsize(os.path.join(args.checkpoint, "model.safetensors")) / 2**20
    print(f"checkpoint {args.checkpoint}: {size:.0f} MiB; CPU: {common.cpu_name()}")
    rows = []
    for round_ in range(args.rounds):
        for world in [int(n) for n in args.ranks.split(",")]:
            for way in args.ways.split(","):
                results = common.launch(os.path.abspath(__file__), world, ["--rank-job", way, args.checkpoint])
                for r in results:
                    r.update(round=round_, world=world, whole_mib=size)
                rows.extend(results)
                worst = max(results, key=lambda r: r["peak_above_baseline_mib"])
                print(f"round {round_} N={world} {way:18s} peak above baseline {worst['peak_above_baseline_mib']:7.0f} "
                      f"MiB (whole/N x 1.1 = {size / world * 1.1:6.0f}), peak RSS {worst['peak_mib']:7.0f} MiB, "
                      f"after a forward {worst['after_forward_above_baseline_mib']:7.0f} MiB, "
                      f"load {max(r['seconds'] for r in results):5.2f} s (proof "
                      f"{max(r['proof_seconds'] for r in results) * 1e3:6.1f} ms), then the first forward "
                      f"{max(r['first_forward_seconds'] for r in results):5.2f} s, local parameters "
                      f"{worst['local_parameter_mib']:6.0f} MiB, loss {results[0]['loss']:.6f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": common.cpu_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
