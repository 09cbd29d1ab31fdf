"""Cost of SHARDTORCH_DEBUG=1 (a cross-rank check before every collective):
the same column+row MLP step on the same ranks, over a normal group and over a
copy of it created in debug mode, timed side by side in one run.

    python benchmarks/debug_overhead.py [--device cuda] [--world-size 2]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def worker(device, batch, hidden, repeats):
    import torch
    import shardtorch as ts
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    ts.distributed.init_process_group(group_size=int(os.environ["WORLD_SIZE"]))
    ts.distributed.register_group("tp_debug", ts.distributed.get_group(), ts.distributed.get_group_ranks())
    steps = {}
    for name in ("tp", "tp_debug"):
        os.environ["SHARDTORCH_DEBUG"] = "1" if name == "tp_debug" else "0"
        torch.manual_seed(0)
        model = torch.nn.Sequential(ts.nn.ParallelLinear(hidden, 4 * hidden, dim=1, group=name, device=device),
                                    torch.nn.ReLU(),
                                    ts.nn.ParallelLinear(4 * hidden, hidden, dim=0, group=name, device=device))
        x = torch.randn(batch, hidden, device=device)

        def step(model=model, x=x):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        step()  # creates the group's communicator, in debug mode or not
        steps[name] = step
    os.environ.pop("SHARDTORCH_DEBUG")
    sync = torch.cuda.synchronize if device == "cuda" else None
    common.write_result(common.time_interleaved(steps, repeats, sync=sync))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.device, args.batch, args.hidden, args.repeats)
        return
    ranks = common.launch(os.path.abspath(__file__), args.world_size,
                          ["--worker", "--device", args.device, "--batch", args.batch, "--hidden", args.hidden,
                           "--repeats", args.repeats])
    normal = max(r["tp"] for r in ranks)
    debug = max(r["tp_debug"] for r in ranks)
    print(f"MLP step (batch {args.batch}, hidden {args.hidden}, 2 collectives per step) on "
          f"{args.world_size} {args.device} ranks: normal {normal * 1e3:.2f} ms, "
          f"SHARDTORCH_DEBUG=1 {debug * 1e3:.2f} ms, ratio {debug / normal:.2f}")


if __name__ == "__main__":
    main()
