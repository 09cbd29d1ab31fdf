"""What the proof costs: ``ts.nn.parallelize(model)`` (verify=True, the default) against
``ts.nn.parallelize(model, verify=False)``, side by side on the same ranks, round-robin.

    python benchmarks/parallelize_proof.py [--world-size 2] [--repeats 5]

Models: the zoo's tiny architectures (tests/distributed/zoo_models.py, float64, 2 layers, width
48-64: parallelize itself takes milliseconds there, so the proof's fixed cost shows most) and the
GPT-2 of benchmarks/transformer.py (6 layers, width 512, vocabulary 32,000, float32). Each timing
builds the model under the same seed (not timed) and times parallelize alone; median of --repeats,
the slowest rank's. Peak memory: the largest tensor memory parallelize allocates beyond what
existed before it (shardtorch.utils.memory.PeakMemory), the largest over ranks.
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
    results = {}
    for name, build in _models().items():
        times = {True: [], False: []}
        peaks = {True: 0, False: 0}
        for _ in range(args.repeats + 1):  # the first round warms up
            for verify in (False, True):
                torch.manual_seed(0)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = build()
                dist.barrier()
                with PeakMemory() as peak:
                    start = time.perf_counter()
                    ts.nn.parallelize(model, verify=verify)
                    elapsed = time.perf_counter() - start
                slowest = torch.tensor([elapsed, float(peak.peak_bytes)], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times[verify].append(slowest[0].item())
                peaks[verify] = max(peaks[verify], int(slowest[1].item()))
                del model
        results[name] = {"parallelize_s": statistics.median(times[False][1:]),
                         "with_proof_s": statistics.median(times[True][1:]),
                         "peak_mib": peaks[False] / 2**20, "peak_with_proof_mib": peaks[True] / 2**20}
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
    from tests.launcher import run_ranks
    outputs = run_ranks([sys.executable, os.path.abspath(__file__), "--rank-main", "--world-size",
                         str(args.world_size), "--repeats", str(args.repeats)], args.world_size, timeout=3600)
    code, output = outputs[0]
    if code != 0:
        sys.exit(output)
    results = json.loads(output.strip().splitlines()[-1])
    print(f"{'model':<14} {'parallelize':>12} {'with proof':>11} {'ratio':>6} {'peak MiB':>9} {'with proof':>11}")
    for name, r in results.items():
        print(f"{name:<14} {r['parallelize_s'] * 1e3:>10.1f}ms {r['with_proof_s'] * 1e3:>9.1f}ms "
              f"{r['with_proof_s'] / r['parallelize_s']:>6.2f} {r['peak_mib']:>9.1f} {r['peak_with_proof_mib']:>11.1f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
