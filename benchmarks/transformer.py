"""A whole GPT-2-style model, tensor-parallel: shardtorch's ``ts.nn.parallelize``
against PyTorch's ``parallelize_module`` (DTensor), side by side in one run.

    python benchmarks/transformer.py [--world-size 2] [--layers 6] [--width 512] [--heads 8]
        [--vocab 32000] [--seq-len 256] [--batch 4] [--repeats 5] [--approaches A,B,...] [--json PATH]

Every approach trains its own copy of the same model (Hugging Face
transformers' GPT2LMHeadModel from a config, the same seed, float32, AdamW) on
the same batch, on ``--world-size`` CPU ranks (Gloo, one thread each), timed
round-robin in one process (benchmarks/common.py: median of ``--repeats``
after a warm-up):

  unsharded        the whole model on each rank, no communication: the floor
                   (one process, one core, doing all the work)
  shardtorch       ts.nn.parallelize(model): heads split by whole heads (GPT-2's
                   fused Conv1D c_attn included), MLP column -> row, vocabulary-
                   parallel embedding and tied LM head; model(ids, labels=ids)
                   computes the vocabulary-parallel loss on the logits' shards
                   (logits="sharded": the step reads only the loss, so the
                   logits are not gathered for the output)
  shardtorch_default  the same with parallelize's default logits="lazy": the
                   output's logits gather the whole when first read, and this
                   step never reads them (its cost against "shardtorch" is
                   what the default costs a step that reads only the loss)
  shardtorch_fused the same, loss by ts.nn.causal_lm_loss(..., fused=True): the
                   LM head + loss chunk by chunk, the logits never formed
  dtensor          torch.distributed.tensor.parallel.parallelize_module with the
                   usual Megatron-style plan for GPT-2's blocks (c_attn, c_fc
                   ColwiseParallel; attention's and MLP's c_proj RowwiseParallel;
                   wte RowwiseParallel(input_layouts=Replicate()); lm_head
                   ColwiseParallel(output_layouts=Replicate()), the logits gathered
                   and the model's own loss on them, as the tutorials do)
  dtensor_loss_parallel  the same blocks, lm_head ColwiseParallel(use_local_output=
                   False) and the loss under torch's ``loss_parallel()`` on the
                   logits' DTensor shards (PyTorch's own vocabulary-parallel loss)

DTensor's Colwise/RowwiseParallel take nn.Linear; GPT-2's Conv1D holds the same
matrix transposed ([in, out]), so for the DTensor runs each Conv1D becomes an
nn.Linear with the transposed weight (the same math), c_attn's output rows
reordered so that each rank's contiguous slice holds the q, k and v of the same
heads, and each attention's ``split_size`` set to its local width (GPT-2 views
heads with -1, so the head count follows); the tied LM head is tied again to the
embedding's sharded weight after parallelize_module. shardtorch runs the model
as built, Conv1D and all.

Reported per approach: step time (forward + backward + AdamW step, median; the
slowest rank's), peak memory per rank (shardtorch.utils.memory.PeakMemory: the
largest tensor memory a step allocates beyond what existed before it, exact CPU
allocator accounting; the largest over ranks), parameter memory per rank, and
the collectives of one step counted by the PyTorch profiler (ProcessGroupGloo
records each as a "gloo:<name>" event, whichever library called it). The first
step's loss of every approach is checked against the unsharded model's (all
start from the same weights and batch). The results go to --json (default
benchmarks/out/transformer.json).
"""
import argparse
import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

APPROACHES = ("unsharded", "shardtorch", "shardtorch_default", "shardtorch_fused", "dtensor", "dtensor_loss_parallel")
LOSS_TOLERANCE = 1e-4  # relative, float32


# ---------------------------------------------------------------- rank side

def _gpt2(args):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # transformers reads it off the class name, which GPT2LMHeadModel's lacks
    return model


def _linear_from_conv1d(conv, row_order=None):
    """nn.Linear computing what transformers' Conv1D computes (its weight is
    [in, out]: the Linear's is its transpose), output rows in ``row_order``."""
    import torch
    weight, bias = conv.weight.detach().t(), conv.bias.detach()
    if row_order is not None:
        weight, bias = weight[row_order], bias[row_order]
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


def _dtensor_gpt2(args, mesh, loss_parallel):
    """GPT-2 under parallelize_module with the Megatron-style plan (see the
    module docstring for the Conv1D conversion)."""
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = _gpt2(args)
    size, width = mesh.size(), args.width
    if args.heads % size:
        raise ValueError(f"DTensor's plan splits heads evenly: --heads {args.heads} over {size} ranks")
    local = width // size
    # c_attn's output is [q | k | v]; rank r's contiguous slice must be [q_r | k_r | v_r].
    order = torch.cat([torch.arange(part * width + r * local, part * width + (r + 1) * local)
                       for r in range(size) for part in range(3)])
    for block in model.transformer.h:
        block.attn.c_attn = _linear_from_conv1d(block.attn.c_attn, order)
        block.attn.c_proj = _linear_from_conv1d(block.attn.c_proj)
        block.attn.split_size = local
        block.mlp.c_fc = _linear_from_conv1d(block.mlp.c_fc)
        block.mlp.c_proj = _linear_from_conv1d(block.mlp.c_proj)
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    head = ColwiseParallel(use_local_output=False) if loss_parallel else ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
                                     "lm_head": head})
    model.lm_head.weight = model.transformer.wte.weight  # tied, as GPT-2's are: both Shard(0) of [vocab, width]
    return model


def _make_step(name, model, ids):
    """One training step of ``model`` (forward, backward, AdamW), returning the loss."""
    import torch
    import torch.nn.functional as F

    import shardtorch as ts
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_of():
        if name == "shardtorch_fused":
            return ts.nn.causal_lm_loss(model, ids, ids, fused=True)
        if name == "dtensor_loss_parallel":
            from torch.distributed.tensor.parallel import loss_parallel
            logits = model(ids).logits  # DTensor, sharded on the vocabulary
            with loss_parallel():
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
            return loss
        return model(ids, labels=ids).loss

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of()
        if name != "dtensor_loss_parallel":  # its backward runs inside loss_parallel()
            loss.backward()
        optimizer.step()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return value.item()
    return step


def _count_collectives(step):
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = step()
    counts = Counter(e.name[len("gloo:"):] for e in prof.events() if e.name.startswith("gloo:"))
    return loss, dict(sorted(counts.items()))


def _local_bytes(model):
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in model.parameters())


def worker(args):
    import torch

    import shardtorch as ts
    from shardtorch.utils.memory import track_cpu_memory
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
    track_cpu_memory()
    mesh = ts.distributed.device_mesh("cpu")["tp"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(args.vocab, (args.batch, args.seq_len), generator=g)  # the same batch on every rank
    models, errors = {}, {}
    for name in args.approaches.split(","):
        try:
            if name == "unsharded":
                models[name] = _gpt2(args)
            elif name == "shardtorch_default":
                models[name] = ts.nn.parallelize(_gpt2(args))
            elif name.startswith("shardtorch"):
                models[name] = ts.nn.parallelize(_gpt2(args), logits="sharded")  # the step reads only the loss
            else:
                models[name] = _dtensor_gpt2(args, mesh, loss_parallel=name == "dtensor_loss_parallel")
        except Exception as e:  # noqa: BLE001 -- recorded and reported, the others still run
            errors[name] = f"{type(e).__name__}: {e}"
    steps = {name: _make_step(name, model, ids) for name, model in models.items()}
    first_loss, collectives, peak = {}, {}, {}
    for name, step in steps.items():  # the first step, counted; it also makes AdamW's state
        first_loss[name], collectives[name] = _count_collectives(step)
    for name, step in steps.items():
        with common.peak_memory("cpu") as m:
            step()
        peak[name] = m.peak_bytes
    times = common.time_interleaved(steps, repeats=args.repeats, warmup=1)
    common.write_result({"time": times, "peak": peak, "collectives": collectives, "first_loss": first_loss,
                         "param_bytes": {name: _local_bytes(model) for name, model in models.items()},
                         "errors": errors})
    ts.distributed.destroy_process_group()


# ---------------------------------------------------------------- driver side

def _merge(ranks):
    merged = {"time": {}, "peak": {}, "param_bytes": {}, "collectives": ranks[0]["collectives"],
              "first_loss": ranks[0]["first_loss"], "errors": ranks[0]["errors"]}
    for name in ranks[0]["time"]:
        merged["time"][name] = max(r["time"][name] for r in ranks)  # a step ends when its slowest rank does
        merged["peak"][name] = max(r["peak"][name] for r in ranks)
        merged["param_bytes"][name] = max(r["param_bytes"][name] for r in ranks)
    reference = merged["first_loss"].get("unsharded")
    merged["loss_error"] = {name: abs(loss - reference) / abs(reference)
                            for name, loss in merged["first_loss"].items()} if reference else {}
    return merged




def _markdown(args, merged):
    mib = 2 ** 20
    lines = [f"GPT-2-style model: {args.layers} layers, width {args.width}, {args.heads} heads, vocabulary "
             f"{args.vocab:,}, batch {args.batch} x {args.seq_len} tokens, float32, {args.world_size} CPU ranks "
             f"(Gloo, 1 thread each) on {common.cpu_name()}; median of {args.repeats} steps",
             "",
             "| approach | step (s) | vs dtensor | peak MiB/rank | vs dtensor | params MiB/rank | collectives per step "
             "| first loss rel. error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base_t, base_m = merged["time"].get("dtensor"), merged["peak"].get("dtensor")
    for name in merged["time"]:
        t, m = merged["time"][name], merged["peak"][name]
        counts = ", ".join(f"{k} {v}" for k, v in merged["collectives"][name].items()) or "none"
        lines.append(f"| {name} | {t:.3f} | {t / base_t:.2f} | {m / mib:.0f} | {m / base_m:.2f} | "
                     f"{merged['param_bytes'][name] / mib:.1f} | {counts} | {merged['loss_error'].get(name, 0):.1e} |"
                     if base_t else f"| {name} | {t:.3f} | - | {m / mib:.0f} | - | - | {counts} | - |")
    for name, error in merged["errors"].items():
        lines.append(f"| {name} | failed: {error} | | | | | | |")
    if "shardtorch" in merged["time"] and "shardtorch_default" in merged["time"]:
        t = merged["time"]["shardtorch_default"] / merged["time"]["shardtorch"]
        m = merged["peak"]["shardtorch_default"] / merged["peak"]["shardtorch"]
        lines += ["", f"shardtorch_default against shardtorch (logits=\"sharded\"): step {t:.3f}x, peak {m:.3f}x"]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="tensor-parallel ranks (default: 2)")
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks (default: 6)")
    parser.add_argument("--width", type=int, default=512, help="hidden size (default: 512)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default: 8)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default: 32000)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default: 4)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per approach (default: 5)")
    parser.add_argument("--approaches", default=",".join(APPROACHES),
                        help=f"comma-separated, in the order timed (default: {','.join(APPROACHES)})")
    parser.add_argument("--json", metavar="PATH", default=os.path.join(common.REPO, "benchmarks", "out",
                                                                       "transformer.json"),
                        help="where the results go (default: benchmarks/out/transformer.json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.approaches.split(",")) - set(APPROACHES)
    if unknown:
        parser.error(f"--approaches: unknown {sorted(unknown)}; known: {', '.join(APPROACHES)}")
    if args.worker:
        worker(args)
        return
    passthrough = ["--layers", args.layers, "--width", args.width, "--heads", args.heads, "--vocab", args.vocab,
                   "--seq-len", args.seq_len, "--batch", args.batch, "--repeats", args.repeats,
                   "--approaches", args.approaches]
    merged = _merge(common.launch(os.path.abspath(__file__), args.world_size, passthrough + ["--worker"]))
    table = _markdown(args, merged)
    print(table)
    bad = {name: e for name, e in merged["loss_error"].items() if e > LOSS_TOLERANCE}
    if bad:
        print(f"WARNING: first-step loss differs from the unsharded model's beyond {LOSS_TOLERANCE}: {bad}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "cpu": common.cpu_name(),
                   "results": merged}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
