"""Tensor parallelism from one process (``ts.tensor_parallel`` / ``from_pretrained(devices=)``) side
by side with the same model under torchrun, and with tensor_parallel 2.0.0, on 2 CPU devices.

    python benchmarks/one_process.py                 # two interleaved rounds
    python benchmarks/one_process.py --rounds 1 --parts torchrun

Part "torchrun": the model of benchmarks/generation.py (Llama-style, 16 layers, width 1024, 970 MiB
in float32), loaded slice by slice on 2 ranks of one thread each:
- "torchrun": ``ts.nn.from_pretrained(path)`` on 2 ranks that torchrun's environment starts;
- "one-process": ``ts.nn.from_pretrained(path, devices=["cpu", "cpu"], threads=1)`` in one process.
Each does --steps training steps (forward with labels=, backward, AdamW over the parameters; median
seconds after one warm-up step) and one greedy ``generate`` (--new-tokens after a --prompt-token
prompt, batch 1; tokens/s after a short warm-up call). Both must produce the same tokens (checked).
Memory: after them, with the model, its gradients and the optimizer's state alive, the proportional
set size (Pss) of each process of the job: a torchrun rank; the caller, its workers and their fork
servers (the caller holds the optimizer's state, where each torchrun rank holds its part).

Part "tensor_parallel": a GPT-2 (12 layers, width 768, vocabulary 50,257, eager attention: the
attention tensor_parallel 2.0.0 splits), float32, random weights (seed 0), a no-grad forward of
--batch x --prompt tokens (median of 5 after 2 warm-ups):
- "one-process": ``ts.tensor_parallel(model, ["cpu", "cpu"])``, 1 thread per rank;
- "tensor_parallel": ``tensor_parallel.tensor_parallel(model, ["cpu", "cpu"])`` (its shards are
  threads of one process), with every core (torch's default threads).
The logits of both are compared with the unsharded model's; "start_s" is the call that splits the
model (starting the workers, and the proof, for ``ts.tensor_parallel``).

Each way runs in a fresh process, round-robin over the rounds. tensor_parallel 2.0.0 imports
pkg_resources, which setuptools 81 and later no longer ship: its process gets the two-line stand-in
in benchmarks/peer_shims/ on its path.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from generation import CONFIG  # noqa: E402  (the same model as benchmarks/generation.py)

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2 = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, attn_implementation="eager")


def _batch(batch, length, vocab):
    import torch
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def _train_and_generate(model, args, distributed):
    import torch
    ids = _batch(args.batch, args.prompt, CONFIG["vocab_size"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    model.eval()
    prompt = _batch(1, args.prompt, CONFIG["vocab_size"])
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(prompt[:, :8], max_new_tokens=2, **options)
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **options)
        seconds = time.perf_counter() - start
    tokens = out[:, args.prompt:]
    # Memory now, with the model, its gradients and the optimizer's state alive: each process's
    # proportional set size (Pss: a page shared by n processes counts 1/n in each, so the sum over a
    # job's processes is what the job holds); for one-process, the caller, its workers and the fork
    # servers the workers came from (they hold the preloaded imports the workers share).
    if distributed:
        pss = {"rank": _pss_kib("self")}
    else:
        from shardtorch.one_process.pool import _SERVERS
        pss = {"caller": _pss_kib("self")}
        for rank, process in enumerate(model._pool.processes):
            pss[f"worker {rank}"] = _pss_kib(process.pid)
        for index, server in _SERVERS._servers.items():
            pss[f"fork server {index}"] = _pss_kib(server.process.pid)
    return {"step_s": statistics.median(times[1:]), "step_times": [round(t, 3) for t in times],
            "tokens_per_s": tokens.numel() / seconds,
            "tokens_sha": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16],
            "pss_mib": {name: kib / 1024 for name, kib in pss.items()}}


def _pss_kib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return int(next(line for line in f if line.startswith("Pss:")).split()[1])


def job(way, args):
    import torch
    import shardtorch as ts
    if way == "torchrun":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        ts.distributed.init_process_group(group_size=dist.get_world_size())
        model = ts.nn.from_pretrained(args.checkpoint)
        result = _train_and_generate(model, args, True)
        dist.destroy_process_group()
        return result
    if way == "one-process":
        with ts.nn.from_pretrained(args.checkpoint, devices=["cpu", "cpu"], threads=1) as model:
            return _train_and_generate(model, args, False)
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    whole = GPT2LMHeadModel(GPT2Config(**GPT2)).eval()
    ids = _batch(args.batch, args.prompt, GPT2["vocab_size"])
    with torch.no_grad():
        expected = whole(ids).logits
    start = time.perf_counter()
    if way == "gpt2-one-process":
        model = ts.tensor_parallel(whole, ["cpu", "cpu"], threads=1)
    else:
        import tensor_parallel
        model = tensor_parallel.tensor_parallel(whole, ["cpu", "cpu"])
    start_s = time.perf_counter() - start
    model.eval()
    times = []
    with torch.no_grad():
        for _ in range(7):
            start = time.perf_counter()
            logits = model(ids).logits
            float(logits[0, 0, 0])  # read them (lazy logits are fetched here)
            times.append(time.perf_counter() - start)
        error = ((logits - expected).abs().max() / expected.abs().max()).item()
    if way == "gpt2-one-process":
        model.close()
    return {"forward_s": statistics.median(times[2:]), "start_s": start_s, "relative_error": error}


def _run(way, args):
    command = [sys.executable, os.path.abspath(__file__), "--job", way, "--checkpoint", args.checkpoint,
               "--batch", str(args.batch), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--steps", str(args.steps)]
    if way == "torchrun":
        ranks = common.launch(os.path.abspath(__file__), 2, command[2:])
        return dict(ranks[0], pss_mib={f"rank {r}": result["pss_mib"]["rank"] for r, result in enumerate(ranks)})
    env = dict(os.environ)
    if way == "gpt2-tensor_parallel":
        env["PYTHONPATH"] = os.path.join(HERE, "peer_shims") + os.pathsep + env.get("PYTHONPATH", "")
    else:
        env["PYTHONPATH"] = common.REPO + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as out:
        env["BENCH_OUT"] = os.path.join(out, "r.json")
        subprocess.run(command, check=True, env=env)
        with open(env["BENCH_OUT"]) as f:
            return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="torchrun,tensor_parallel")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpoint", default=os.path.join(HERE, "out", "llama-16"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return common.write_result(job(args.job, args))
    common.llama_checkpoint(args.checkpoint, CONFIG)
    print(f"CPU: {common.cpu_name()} ({os.cpu_count()} cores); batch {args.batch} x {args.prompt} tokens")
    ways = []
    if "torchrun" in args.parts:
        ways += ["torchrun", "one-process"]
    if "tensor_parallel" in args.parts:
        ways += ["gpt2-one-process", "gpt2-tensor_parallel"]
    rows = []
    for round_ in range(args.rounds):
        for way in ways:
            result = dict(_run(way, args), way=way, round=round_)
            rows.append(result)
            print(json.dumps(result), flush=True)
    hashes = {row["tokens_sha"] for row in rows if "tokens_sha" in row}
    if len(hashes) > 1:
        raise SystemExit(f"the ways generated different tokens: {sorted(hashes)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": common.cpu_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
