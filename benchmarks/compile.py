"""torch.compile of a parallelized model: compile time and step time against eager, with the compile
cache the ranks share (torch's default: one TORCHINDUCTOR_CACHE_DIR for every process).

    python benchmarks/compile.py [--world-size 2] [--repeats 10]

Two launches of fresh processes on the same ranks, sharing one new cache folder:
- cold: the cache is empty; each rank times its first compiled training step (the compile), then
  eager and compiled steps round-robin (median of --repeats);
- warm: new processes, the same folder: the first compiled step reads the graphs the cold launch
  wrote (each rank its own: shardtorch adds the rank to torch's cache key), then the same timing.
Model: GPT-2 (4 layers, width 256, 8 heads, vocabulary 8,000, sequence 128, batch 4, float32),
``ts.nn.parallelize(model, logits="sharded")``, trained by the model's
own loss (``labels=``): forward and backward, no optimizer. The slowest rank's figures.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def rank_job(phase: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import shardtorch as ts
    dist.init_process_group("gloo")
    ts.distributed.init_process_group(group_size=dist.get_world_size())
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=8000, n_positions=128, n_embd=256, n_layer=4, n_head=8, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ts.nn.parallelize(GPT2LMHeadModel(config).train(), logits="sharded")
    compiled = torch.compile(model)
    ids = torch.randint(0, 8000, (4, 128), generator=torch.Generator().manual_seed(1))

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
        return run

    dist.barrier()
    start = time.perf_counter()
    step(compiled)()
    first = time.perf_counter() - start
    times = common.time_interleaved({"eager": step(model), "compiled": step(compiled)}, repeats)
    worst = torch.tensor([first, times["eager"], times["compiled"]], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    common.write_result({"phase": phase, "first_compiled_step_s": worst[0].item(),
                         "eager_step_s": worst[1].item(), "compiled_step_s": worst[2].item()})
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rank-job", nargs=2, metavar=("PHASE", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        return rank_job(args.rank_job[0], int(args.rank_job[1]))
    print(f"CPU: {common.cpu_name()}, {args.world_size} ranks")
    with tempfile.TemporaryDirectory(prefix="shardtorch-compile-cache-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the ranks inherit it: one cache, shared
        for phase in ("cold", "warm"):
            result = common.launch(os.path.abspath(__file__), args.world_size,
                                   ["--rank-job", phase, str(args.repeats)])[0]
            print(json.dumps(result))
            print(f"{phase}: first compiled step {result['first_compiled_step_s']:.1f} s; step eager "
                  f"{result['eager_step_s'] * 1e3:.0f} ms, compiled {result['compiled_step_s'] * 1e3:.0f} ms "
                  f"({result['compiled_step_s'] / result['eager_step_s']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
