"""shardtorch against the tensor-parallel libraries users compare it with, side
by side on the same ranks and shapes: TorchShard, FairScale
(fairscale.nn.model_parallel) and Megatron-core (megatron.core.tensor_parallel).

    bash scripts/setup_peers.sh        # once: the peers, into benchmarks/.peers
    python benchmarks/peers.py [--which linear,ce] [--repeats 10]
        [--classes 100000] [--ce-batch 1024] [--json PATH] [--markdown PATH]

(it runs scripts/setup_peers.sh itself when benchmarks/.peers is missing; the
peers never go into the virtual environment).

2 CPU ranks (Gloo, one thread each), float32, each library used through its
documented API:

  column   batch 256, 1024 -> 4096, output left sharded: ts ParallelLinear(dim=1),
           TorchShard ParallelLinear(dim=1), FairScale / Megatron
           ColumnParallelLinear(gather_output=False)
  row      the input sharded on features: ts ParallelLinear(dim=0), TorchShard
           ParallelLinear(dim=0) (input marked parallel_dim=-1), FairScale /
           Megatron RowParallelLinear(input_is_parallel=True)
  ce       logits [batch, classes/2] per rank, mean loss: ts ParallelCrossEntropyLoss,
           TorchShard ParallelCrossEntropyLoss, FairScale / Megatron
           vocab_parallel_cross_entropy(...).mean()

Every layer gets the same full weights (slices of one torch.nn.Linear), a step is
forward + backward (y.sum().backward(), as benchmarks/parallel_linear.py), and
the approaches are timed round-robin in one process (median of --repeats).
Reported: time ratio peer / shardtorch (> 1: shardtorch faster), peak extra
tensor memory per rank of one step (shardtorch.utils.memory.PeakMemory, exact
CPU allocator accounting: everything a step allocates, gradients included,
beyond the parameters and inputs), and the largest relative error of each
library's outputs and gradients against unsharded torch (random upstream
gradient). FairScale's and Megatron's losses overwrite their input logits (by
design, to save memory); they get a fresh copy before every step, outside the
timed and measured region, and the results say so.
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PEERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".peers")
APPROACHES = ("shardtorch", "torchshard", "fairscale", "megatron")
TOLERANCE = 1e-4  # largest relative error accepted (float32, sums over <= 100k terms)


# ---------------------------------------------------------------- rank side

def _init_peers(size):
    """Each library's own group set-up; a library that fails is recorded."""
    import torch
    errors = {}
    try:
        import torchshard
        torchshard.distributed.init_process_group(group_size=size)
    except Exception as e:  # noqa: BLE001
        errors["torchshard"] = f"{type(e).__name__}: {e}"
    try:
        from fairscale.nn.model_parallel import initialize_model_parallel
        initialize_model_parallel(size)
    except Exception as e:  # noqa: BLE001
        errors["fairscale"] = f"{type(e).__name__}: {e}"
    try:
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)
    except Exception as e:  # noqa: BLE001
        errors["megatron"] = f"{type(e).__name__}: {e}"
    del torch
    return errors


def _megatron_config(size):
    import torch
    from megatron.core.model_parallel_config import ModelParallelConfig
    # The documented CPU path: parameters made and initialised on the CPU.
    return ModelParallelConfig(tensor_model_parallel_size=size, use_cpu_initialization=True,
                               params_dtype=torch.float32, perform_initialization=True)


def _linear_layer(approach, kind, in_f, out_f, size):
    """The library's layer; returns (module, call) where call(x) -> output."""
    import torch
    if approach == "shardtorch":
        import shardtorch as ts
        layer = ts.nn.ParallelLinear(in_f, out_f, dim=1 if kind == "column" else 0)
        return layer, layer
    if approach == "torchshard":
        import torchshard
        layer = torchshard.nn.ParallelLinear(in_f, out_f, dim=1 if kind == "column" else 0)

        def call(x):
            if kind == "row":  # the input is this rank's shard, as a column layer's output is
                torchshard.register_parallel_dim(x, -1)
            return layer(x)
        return layer, call
    if approach == "fairscale":
        from fairscale.nn.model_parallel import ColumnParallelLinear, RowParallelLinear
        layer = (ColumnParallelLinear(in_f, out_f, gather_output=False) if kind == "column"
                 else RowParallelLinear(in_f, out_f, input_is_parallel=True))
        return layer, layer
    from megatron.core import tensor_parallel
    cfg = _megatron_config(size)
    init = torch.nn.init.xavier_normal_
    if kind == "column":
        layer = tensor_parallel.ColumnParallelLinear(in_f, out_f, config=cfg, init_method=init, bias=True,
                                                     gather_output=False)
    else:
        layer = tensor_parallel.RowParallelLinear(in_f, out_f, config=cfg, init_method=init, bias=True,
                                                  input_is_parallel=True, skip_bias_add=False)
    return layer, lambda x: layer(x)[0]  # (output, bias); the bias is added inside


def _load_linear(layer, kind, weight, bias, rank, size):
    """Copies this rank's slice of the full (weight, bias) into the layer."""
    import torch
    out_f, in_f = weight.shape
    with torch.no_grad():
        if kind == "column":
            n = out_f // size
            layer.weight.copy_(weight[rank * n:(rank + 1) * n])
            layer.bias.copy_(bias[rank * n:(rank + 1) * n])
        else:
            n = in_f // size
            layer.weight.copy_(weight[:, rank * n:(rank + 1) * n])
            layer.bias.copy_(bias)


def _rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _linear_worker(kind, batch, in_f, out_f, repeats):
    import torch
    import torch.nn.functional as F
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    errors = _init_peers(size)
    g = torch.Generator().manual_seed(1234)
    ref = torch.nn.Linear(in_f, out_f)
    weight, bias = ref.weight.detach().clone(), ref.bias.detach().clone()
    x_full = torch.randn(batch, in_f, generator=g)
    grad_full = torch.randn(batch, out_f, generator=g)
    n_in, n_out = in_f // size, out_f // size
    x_local = x_full if kind == "column" else x_full[:, rank * n_in:(rank + 1) * n_in].contiguous()
    grad_local = grad_full[:, rank * n_out:(rank + 1) * n_out] if kind == "column" else grad_full

    # Unsharded reference with a random upstream gradient.
    xr, wr, br = (t.clone().requires_grad_() for t in (x_full, weight, bias))
    yr = F.linear(xr, wr, br)
    yr.backward(grad_full)
    ref_out = yr.detach()[:, rank * n_out:(rank + 1) * n_out] if kind == "column" else yr.detach()
    ref_dx = xr.grad if kind == "column" else xr.grad[:, rank * n_in:(rank + 1) * n_in]
    ref_dw = wr.grad[rank * n_out:(rank + 1) * n_out] if kind == "column" else wr.grad[:, rank * n_in:(rank + 1) * n_in]
    ref_db = br.grad[rank * n_out:(rank + 1) * n_out] if kind == "column" else br.grad

    steps, check, peak = {}, {}, {}
    for approach in APPROACHES:
        if approach in errors:
            continue
        try:
            layer, call = _linear_layer(approach, kind, in_f, out_f, size)
            _load_linear(layer, kind, weight, bias, rank, size)
            x = x_local.clone().requires_grad_()
            # Correctness: outputs and gradients against unsharded torch.
            y = call(x)
            y.backward(grad_local)
            check[approach] = {"output": _rel_err(y.detach(), ref_out), "grad_input": _rel_err(x.grad, ref_dx),
                               "grad_weight": _rel_err(layer.weight.grad, ref_dw),
                               "grad_bias": _rel_err(layer.bias.grad, ref_db)}
        except Exception as e:  # noqa: BLE001
            errors[approach] = f"{type(e).__name__}: {e}"
            continue

        def reset(layer=layer, x=x):
            layer.zero_grad(set_to_none=True)
            x.grad = None

        def run(layer=layer, call=call, x=x):
            call(x).sum().backward()
        steps[approach] = (reset, run)
    return _measure(steps, repeats, check, errors)


def _ce_worker(batch, classes, repeats):
    import torch
    import torch.nn.functional as F
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    errors = _init_peers(size)
    local = classes // size
    g = torch.Generator().manual_seed(1234)
    full = torch.randn(batch, classes, generator=g) * 4
    target = torch.randint(0, classes, (batch,), generator=g)
    shard = full[:, rank * local:(rank + 1) * local].contiguous()

    fr = full.clone().requires_grad_()
    loss_ref = F.cross_entropy(fr, target)
    loss_ref.backward()
    ref_grad = fr.grad[:, rank * local:(rank + 1) * local].clone()
    # Secondary check on 64 rows: a quarter of the targets are torch's default
    # ignore_index (-100), which every library's loss is documented or expected
    # to skip as F.cross_entropy does (those without the argument get the same
    # targets and must be reported when they count the rows).
    rows = min(64, batch)
    t_ign = target[:rows].clone()
    t_ign[::4] = -100
    fi = full[:rows].clone().requires_grad_()
    loss_ign_ref = F.cross_entropy(fi, t_ign)
    loss_ign_ref.backward()
    ref_ign_grad = fi.grad[:, rank * local:(rank + 1) * local].clone()
    del fr, full, fi

    def loss_fn(approach):
        if approach == "shardtorch":
            import shardtorch as ts
            crit = ts.nn.ParallelCrossEntropyLoss(parallel=True, num_classes=classes)
            return crit
        if approach == "torchshard":
            import torchshard
            crit = torchshard.nn.ParallelCrossEntropyLoss()

            def call(logits, t):
                torchshard.register_parallel_dim(logits, -1)  # what its ParallelLinear(dim=1) marks
                return crit(logits, t)
            return call
        if approach == "fairscale":
            from fairscale.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy
            return lambda logits, t: vocab_parallel_cross_entropy(logits, t).mean()
        from megatron.core import tensor_parallel
        return lambda logits, t: tensor_parallel.vocab_parallel_cross_entropy(logits, t).mean()

    steps, check, notes, ignore = {}, {}, {}, {}
    for approach in APPROACHES:
        if approach in errors:
            continue
        try:
            fn = loss_fn(approach)
            small = shard[:rows].clone().requires_grad_()
            loss = fn(small, t_ign)
            loss.backward()
            ignore[approach] = max(_rel_err(loss.detach(), loss_ign_ref.detach()),
                                   _rel_err(small.grad, ref_ign_grad))
        except Exception as e:  # noqa: BLE001
            ignore[approach] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        try:
            logits = shard.clone().requires_grad_()
            loss = fn(logits, target)
            loss.backward()
            check[approach] = {"loss": _rel_err(loss.detach(), loss_ref.detach()),
                               "grad_input": _rel_err(logits.grad, ref_grad)}
            if not torch.equal(logits.detach(), shard):
                notes[approach] = "overwrites its input logits"
            del loss
        except Exception as e:  # noqa: BLE001
            errors[approach] = f"{type(e).__name__}: {e}"
            continue

        def reset(logits=logits):
            logits.grad = None
            with torch.no_grad():
                logits.copy_(shard)  # undo an in-place loss; untimed, unmeasured

        def run(fn=fn, logits=logits):
            fn(logits, target).backward()
        steps[approach] = (reset, run)
    result = _measure(steps, repeats, check, errors)
    result["notes"], result["ignore_index"] = notes, ignore
    return result


def _measure(steps, repeats, check, errors, warmup=2):
    """Round-robin timing (reset outside the timed region) and one measured step each."""
    import torch.distributed as dist
    seconds = common.time_interleaved(
        {name: run for name, (_, run) in steps.items()}, repeats, warmup,
        prepare={name: (lambda reset=reset: (reset(), dist.barrier())) for name, (reset, _) in steps.items()})
    peak = {}
    for name, (reset, run) in steps.items():
        reset()
        dist.barrier()
        with common.peak_memory("cpu") as p:
            run()
        peak[name] = p.peak_bytes
        reset()
    return {"seconds": seconds, "peak_bytes": peak,
            "check": check, "errors": errors}


def worker(args):
    import torch
    sys.path.append(PEERS_DIR)  # after site-packages: the peers never shadow torch
    import shardtorch as ts
    torch.set_num_threads(1)
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    if args.worker == "ce":
        result = _ce_worker(args.ce_batch, args.classes, args.repeats)
    else:
        result = _linear_worker(args.worker, args.batch, args.in_features, args.out_features, args.repeats)
    result["shardtorch_file"] = ts.__file__
    common.write_result(result)


# ---------------------------------------------------------------- launcher side

def _merge(ranks):
    """The slowest rank's time and the largest rank's memory and error."""
    names = ranks[0]["seconds"].keys()
    out = {"seconds": {n: max(r["seconds"][n] for r in ranks) for n in names},
           "peak_bytes": {n: max(r["peak_bytes"][n] for r in ranks) for n in names},
           "check": {n: {k: max(r["check"][n][k] for r in ranks) for k in ranks[0]["check"][n]}
                     for n in ranks[0]["check"]},
           "errors": {k: v for r in ranks for k, v in r["errors"].items()},
           "notes": {k: v for r in ranks for k, v in r.get("notes", {}).items()},
           "ignore_index": {k: (max(r["ignore_index"][k] for r in ranks)
                                if all(isinstance(r["ignore_index"][k], float) for r in ranks)
                                else next(r["ignore_index"][k] for r in ranks
                                          if not isinstance(r["ignore_index"][k], float)))
                            for k in ranks[0].get("ignore_index", {})},
           "shardtorch_file": ranks[0]["shardtorch_file"]}
    return out


def _markdown(args, results):
    mib = 2 ** 20
    lines = [f"2 CPU ranks (Gloo, 1 thread each), float32. Linear: batch {args.batch}, "
             f"{args.in_features} -> {args.out_features}, forward + backward. Cross-entropy: batch "
             f"{args.ce_batch}, {args.classes} classes ({args.classes // args.world_size} per rank), "
             f"forward + backward. Time: median of {args.repeats} interleaved steps, slowest rank; "
             f"ratio = library / shardtorch (> 1: shardtorch faster). Memory: peak extra MiB per rank "
             f"of one step. Max rel. error: largest over outputs and gradients against unsharded torch.",
             "", "| layer | library | step ms | time ratio | peak MiB/rank | memory ratio | max rel. error | note |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for kind, res in results.items():
        st_t, st_m = res["seconds"].get("shardtorch"), res["peak_bytes"].get("shardtorch")
        for name in APPROACHES:
            if name in res["errors"]:
                lines.append(f"| {kind} | {name} | - | - | - | - | - | could not run: "
                             f"{res['errors'][name].splitlines()[0][:200]} |")
                continue
            t, m = res["seconds"][name], res["peak_bytes"][name]
            err = max(res["check"][name].values())
            note = res["notes"].get(name, "")
            if err > TOLERANCE:
                note = (note + "; " if note else "") + "DISAGREES with unsharded torch: " + ", ".join(
                    f"{k} {v:.2g}" for k, v in res["check"][name].items() if v > TOLERANCE)
            lines.append(f"| {kind} | {name} | {t * 1e3:.1f} | {t / st_t:.2f} | {m / mib:.1f} | "
                         f"{m / st_m if st_m else float('nan'):.2f} | {err:.1e} | {note} |")
    ign = {k: res["ignore_index"] for k, res in results.items() if res.get("ignore_index")}
    for kind, checks in ign.items():
        lines += ["", f"ignore_index check ({kind}, 64 rows, a quarter of the targets -100; "
                  "max rel. error of loss and gradient against F.cross_entropy):", "",
                  "| library | result |", "|---|---|"]
        for name, v in checks.items():
            text = (f"agrees ({v:.1e})" if v <= TOLERANCE else f"DISAGREES (rel. error {v:.2g})") \
                if isinstance(v, float) else f"fails: {v}"
            lines.append(f"| {name} | {text} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--which", default="linear,ce",
                        help="comma-separated: linear (column and row), column, row, ce")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--in-features", type=int, default=1024)
    parser.add_argument("--out-features", type=int, default=4096)
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--ce-batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", metavar="PATH", help="write the merged results as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not os.path.isdir(PEERS_DIR):
        print("peers: benchmarks/.peers is missing, running scripts/setup_peers.sh", flush=True)
        subprocess.run(["bash", os.path.join(common.REPO, "scripts", "setup_peers.sh")], check=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    kinds = []
    for w in args.which.split(","):
        kinds += ["column", "row"] if w == "linear" else [w]
    passthrough = ["--batch", args.batch, "--in-features", args.in_features, "--out-features",
                   args.out_features, "--classes", args.classes, "--ce-batch", args.ce_batch,
                   "--repeats", args.repeats]
    results = {}
    for kind in kinds:
        ranks = common.launch(os.path.abspath(__file__), args.world_size, passthrough + ["--worker", kind])
        results[kind] = _merge(ranks)
        print(f"{kind}: done (shardtorch from {results[kind]['shardtorch_file']})", flush=True)
    table = _markdown(args, results)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
