"""Generation with a tensor-parallel model on CPU ranks: tokens/s and peak memory per rank,
shardtorch against transformers' own tensor parallelism and the unsharded model.

    python benchmarks/generation.py                       # batch 1 and 8, two interleaved rounds
    python benchmarks/generation.py --batches 8 --rounds 1

The model: a Llama-style checkpoint (16 layers, width 1024, 16 query / 8 key-value heads, MLP
2816, vocabulary 32,000, untied head; 970 MiB in float32) made once under benchmarks/out/.
Greedy decoding of --new-tokens tokens after a prompt of --prompt tokens (random ids, the same for
every way), each way in fresh processes, one after the other, round-robin over the rounds:
- shardtorch, 2 ranks: ``ts.nn.from_pretrained(path)`` then ``generate``;
- transformers, 2 ranks: ``from_pretrained(path, tp_plan="auto")`` then ``generate``;
- unsharded, 1 process: ``from_pretrained(path)`` then ``generate``, with as many threads as one
  rank has (torchrun gives each rank OMP_NUM_THREADS=1) and, as "unsharded-all-cores", with every
  core.
Per rank: tokens/s (new tokens x batch / the generate call's wall time, after one short warm-up
call), and the peak resident memory above the process's after its imports (VmHWM, reset then).
Every way must produce the same tokens (checked).
"""
import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False)


def rank_job(way, path, batch, prompt, new_tokens):
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import shardtorch as ts
    AutoConfig.from_pretrained(path)  # lazy imports into the baseline, as benchmarks/loading.py does
    distributed = way in ("shardtorch", "transformers")
    if distributed:
        dist.init_process_group("gloo")
        if way == "shardtorch":
            ts.distributed.init_process_group(group_size=dist.get_world_size())
    baseline = common.reset_peak_resident_memory()
    if way == "shardtorch":
        model = ts.nn.from_pretrained(path)
    elif way == "transformers":
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(0))
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, **options)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
        seconds = time.perf_counter() - start
    peak = common.status_kib("VmHWM")
    tokens = out[:, prompt:]
    common.write_result({"way": way, "batch": batch, "seconds": seconds,
                         "tokens_per_s": tokens.numel() / seconds, "peak_above_baseline_mib": (peak - baseline) / 1024,
                         "tokens_sha": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16]})
    if distributed:
        dist.destroy_process_group()


def _run_one(way, world, args, batch):
    job = ["--rank-job", way, args.checkpoint, str(batch), str(args.prompt), str(args.new_tokens)]
    if world == 1:
        threads = os.cpu_count() if way == "unsharded-all-cores" else 1
        import subprocess
        import tempfile
        with tempfile.TemporaryDirectory() as out:
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), BENCH_OUT=os.path.join(out, "r.json"))
            subprocess.run([sys.executable, os.path.abspath(__file__), *job], check=True, env=env)
            with open(env["BENCH_OUT"]) as f:
                return [json.load(f)]
    return common.launch(os.path.abspath(__file__), world, job)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8", help="batch sizes (default: 1,8)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (default: 128)")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens (default: 128)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    parser.add_argument("--ways", default="shardtorch,transformers,unsharded,unsharded-all-cores")
    parser.add_argument("--checkpoint", default=os.path.join(common.REPO, "benchmarks", "out", "llama-16"))
    parser.add_argument("--json", default=None, help="write every rank's figures to this file")
    parser.add_argument("--rank-job", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        way, path, batch, prompt, new = args.rank_job
        return rank_job(way, path, int(batch), int(prompt), int(new))
    common.llama_checkpoint(args.checkpoint, CONFIG)
    print(f"checkpoint {args.checkpoint}; CPU: {common.cpu_name()} ({os.cpu_count()} cores); prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, greedy")
    rows = []
    for round_ in range(args.rounds):
        for batch in [int(b) for b in args.batches.split(",")]:
            for way in args.ways.split(","):
                world = 2 if way in ("shardtorch", "transformers") else 1
                results = _run_one(way, world, args, batch)
                for r in results:
                    r.update(round=round_, world=world)
                rows.extend(results)
                slowest = min(r["tokens_per_s"] for r in results)
                worst = max(r["peak_above_baseline_mib"] for r in results)
                print(f"round {round_} batch {batch} {way:20s} ranks {world}: {slowest:7.1f} tokens/s, peak "
                      f"{worst:7.0f} MiB above the imports per rank, tokens {results[0]['tokens_sha']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": common.cpu_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
