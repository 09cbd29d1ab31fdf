"""What the proof costs: ``ts.nn.parallelize(model, verify=False)``, against the proof run
(``SHARDTORCH_PROOF_CACHE=0``: every call proves) and against the default, which reuses the proof
kept by an earlier call (shardtorch/nn/whole_model/proof_cache.py: the key checked instead of the
probe batch run), side by side on the same ranks, round-robin.

    python benchmarks/parallelize_proof.py [--world-size 2] [--repeats 5]

Models: the zoo's tiny architectures (tests/distributed/zoo_models.py, float64, 2 layers, width
48-64: parallelize itself takes milliseconds there, so the proof's fixed cost shows most) and the
GPT-2 of benchmarks/transformer.py (6 layers, width 512, vocabulary 32,000, float32). Each timing
builds the model under the same seed (not timed) and times parallelize alone; median of --repeats,
the slowest rank's; the order of the three ways rotates each round. A kept proof also keeps the plan it
proved, read again on the model instead of resolved: "key" is the median time rank 0 spends computing
the key (describing the model, checking its code), "again" reading the kept plan again, "agree" the
all-gather in which the ranks agree on the kept proof, all inside parallelize with the proof kept;
"resolve" the median time verify=False spends resolving the plan, and "agree (off)" its all-gather on
proving. The proofs are kept in a fresh folder (the warm-up round fills it). Peak memory: the largest
tensor memory parallelize allocates beyond what existed before it (shardtorch.utils.memory.PeakMemory),
the largest over ranks.
"""
import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpt2_512():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=32000, n_positions=256, n_embd=512, n_layer=6, n_head=8,
                                      attn_implementation="eager"))


def _models():
    from tests.distributed.zoo_models import ZOO
    chosen = {name: (lambda build=build: build().double()) for name, (build, _) in ZOO.items()
              if name in ("gpt_neox", "mistral", "qwen2", "mixtral", "gpt_bigcode", "roberta", "t5", "swin")}
    chosen["gpt2_512"] = _gpt2_512
    return chosen


def _rank_main(args):
    import torch.distributed as dist
    import shardtorch as ts
    from shardtorch.utils.memory import PeakMemory
    ts.distributed.init_process_group(group_size=args.world_size)
    ways = {"verify=False": dict(verify=False), "proving": dict(), "proof kept": dict()}
    from shardtorch.nn.whole_model import apply, proof, proof_cache
    from benchmarks.common import time_spent_in
    steps = {"key": time_spent_in(proof_cache, "key"), "again": time_spent_in(apply, "read_again"),
             "agree": time_spent_in(proof_cache, "agree"), "resolve": time_spent_in(apply, "resolve"),
             "agree (off)": time_spent_in(proof, "agree_before_split")}
    kept_steps, off_steps = ("key", "again", "agree"), ("resolve", "agree (off)")
    results = {}
    for name, build in _models().items():
        times = {way: [] for way in ways}
        spent = {step: [] for step in steps}
        peaks = {way: 0 for way in ways}
        for round_ in range(args.repeats + 1):  # the first round warms up (and keeps the proof)
            order = list(ways.items())
            for way, options in order[round_ % 3:] + order[:round_ % 3]:  # each way after each other in turn
                os.environ["SHARDTORCH_PROOF_CACHE"] = "0" if way == "proving" else "1"
                torch.manual_seed(0)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = build()
                dist.barrier()
                for step in steps.values():
                    step[0] = 0.0
                with PeakMemory() as peak:
                    start = time.perf_counter()
                    ts.nn.parallelize(model, **options)
                    elapsed = time.perf_counter() - start
                slowest = torch.tensor([elapsed, float(peak.peak_bytes)], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times[way].append(slowest[0].item())
                if round_ > 0:
                    peaks[way] = max(peaks[way], int(slowest[1].item()))
                    for step in kept_steps if way == "proof kept" else off_steps if way == "verify=False" else ():
                        spent[step].append(steps[step][0])
                del model
        results[name] = {"parallelize_s": statistics.median(times["verify=False"][1:]),
                         "with_proof_s": statistics.median(times["proving"][1:]),
                         "proof_kept_s": statistics.median(times["proof kept"][1:]),
                         **{f"{step}_s": statistics.median(values) for step, values in spent.items()},
                         "peak_mib": peaks["verify=False"] / 2**20, "peak_with_proof_mib": peaks["proving"] / 2**20,
                         "peak_proof_kept_mib": peaks["proof kept"] / 2**20}
    if dist.get_rank() == 0:
        print(json.dumps(results))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out", "parallelize_proof.json"))
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return _rank_main(args)
    import tempfile
    from tests.launcher import run_ranks
    os.environ["SHARDTORCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardtorch-bench-proofs-")  # the ranks inherit it
    outputs = run_ranks([sys.executable, os.path.abspath(__file__), "--rank-main", "--world-size",
                         str(args.world_size), "--repeats", str(args.repeats)], args.world_size, timeout=3600)
    code, output = outputs[0]
    if code != 0:
        sys.exit(output)
    results = json.loads(output.strip().splitlines()[-1])
    from benchmarks.common import cpu_name
    print(f"CPU: {cpu_name()}; {args.world_size} ranks; milliseconds, the slowest rank's median")
    print(f"{'model':<14} {'verify=False':>12} {'proving':>9} {'ratio':>6} {'proof kept':>11} {'ratio':>6} "
          f"{'key':>6} {'again':>6} {'agree':>6} {'resolve':>8} {'agree(off)':>10} {'peak MiB':>9} {'proving':>8} "
          f"{'kept':>6}")
    for name, r in results.items():
        base = r["parallelize_s"]
        print(f"{name:<14} {base * 1e3:>12.2f} {r['with_proof_s'] * 1e3:>9.2f} {r['with_proof_s'] / base:>6.2f} "
              f"{r['proof_kept_s'] * 1e3:>11.2f} {r['proof_kept_s'] / base:>6.3f} {r['key_s'] * 1e3:>6.2f} "
              f"{r['again_s'] * 1e3:>6.2f} {r['agree_s'] * 1e3:>6.2f} {r['resolve_s'] * 1e3:>8.2f} "
              f"{r['agree (off)_s'] * 1e3:>10.2f} {r['peak_mib']:>9.1f} {r['peak_with_proof_mib']:>8.1f} "
              f"{r['peak_proof_kept_mib']:>6.1f}")
    results["cpu"] = cpu_name()
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
