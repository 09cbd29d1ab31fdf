"""ParallelLinear against PyTorch DTensor tensor parallelism (ColwiseParallel /
RowwiseParallel) on the same shapes, forward + backward, side by side.

    python benchmarks/parallel_linear.py                 # 2 CPU ranks (Gloo)
    python benchmarks/parallel_linear.py --device cuda   # one rank per GPU (NCCL)

Prints the time ratio DTensor / shardtorch (> 1: shardtorch faster) and the peak
extra memory per rank of one step of each approach, measured in one run.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def build(approach, kind, in_f, out_f, device, dtype):
    import torch
    import shardtorch as ts
    torch.manual_seed(0)
    if approach == "shardtorch":
        return ts.nn.ParallelLinear(in_f, out_f, dim=1 if kind == "column" else 0, device=device, dtype=dtype)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor import Shard
    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(in_f, out_f, device=device, dtype=dtype))
    style = ColwiseParallel() if kind == "column" else RowwiseParallel(input_layouts=Shard(-1))
    return parallelize_module(model, mesh, {"0": style})


def make_step(layer, kind, batch, in_f, device, dtype):
    import torch
    import shardtorch as ts
    size = torch.distributed.get_world_size()
    local_in = in_f if kind == "column" else ts._C.shard_size(in_f, size, torch.distributed.get_rank())
    x = torch.randn(batch, local_in, device=device, dtype=dtype, requires_grad=True)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x)
        y.sum().backward()
    return step


def worker(kind, batch, in_f, out_f, device, repeats):
    import torch
    import shardtorch as ts
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
    dtype = torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else None
    steps = {a: make_step(build(a, kind, in_f, out_f, device, dtype), kind, batch, in_f, device, dtype)
             for a in ("shardtorch", "dtensor")}
    result = {"seconds": common.time_interleaved(steps, repeats, sync=sync), "peak_bytes": {}}
    for name, step in steps.items():
        with common.peak_memory(device) as peak:
            step()
        result["peak_bytes"][name] = peak.peak_bytes
    common.write_result(result)
    ts.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--in-features", type=int, default=1024)
    parser.add_argument("--out-features", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--worker", metavar="KIND", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.batch, args.in_features, args.out_features)
    if args.worker:
        worker(args.worker, *shape, args.device, args.repeats)
        return
    me = os.path.abspath(__file__)
    common_args = ["--device", args.device, "--batch", args.batch, "--in-features", args.in_features,
                   "--out-features", args.out_features, "--repeats", args.repeats]
    print(f"ParallelLinear vs DTensor, {args.world_size} ranks on {args.device}, float32, "
          f"batch {args.batch}, in {args.in_features}, out {args.out_features}, forward+backward")
    print(f"{'layer':8} {'shardtorch ms':>14} {'DTensor ms':>11} {'ratio':>6} "
          f"{'shardtorch MiB/rank':>20} {'DTensor MiB/rank':>17}")
    rows = []
    for kind in ("column", "row"):
        ranks = common.launch(me, args.world_size, common_args + ["--worker", kind])
        t_st = max(r["seconds"]["shardtorch"] for r in ranks)
        t_dt = max(r["seconds"]["dtensor"] for r in ranks)
        mem = {a: max(r["peak_bytes"][a] for r in ranks) for a in ("shardtorch", "dtensor")}
        rows.append((kind, t_st, t_dt, mem))
        print(f"{kind:8} {t_st * 1e3:14.2f} {t_dt * 1e3:11.2f} {t_dt / t_st:6.2f} "
              f"{mem['shardtorch'] / 2**20:20.1f} {mem['dtensor'] / 2**20:17.1f}", flush=True)


if __name__ == "__main__":
    main()
