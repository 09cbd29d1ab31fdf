"""Per-rank peak training memory against the number of classes, as TorchShard's
blog draws it (figures 2-4): plain DDP, DDP + shardtorch, + AMP, + ZeRO; and
the model state (parameters + gradients + optimizer state) per rank under DDP,
DDP + shardtorch, FSDP2 (fully_shard over all ranks) and FSDP2 + shardtorch
(fully_shard over the data-parallel dimension, shardtorch over the
tensor-parallel one), against the ideal 1/(dp x tp) of the whole model.

Each point is a short run of the main job (examples/python/train_classifier.py)
on its own processes; the program measures its own peak (exact CPU allocator
accounting, or the CUDA allocator) and, for the DDP baseline, the same model
unsharded on the same rank. Writes a Markdown table and a PNG.

    python benchmarks/memory_scaling.py                         # 4 CPU ranks, small sizes
    python benchmarks/memory_scaling.py --device cuda --nproc 8 --classes 100000,500000,1000000
"""
import argparse
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(REPO, "examples", "python", "train_classifier.py")
LINE = re.compile(r"\[rank 0\] parameters\s+([\d.]+) MiB \(unsharded\s+([\d.]+) MiB.*peak training memory\s+"
                  r"([\d.]+) MiB(?: \(unsharded\s+([\d.]+) MiB)?")
SERIES = [("DDP + shardtorch", []), ("+ AMP", ["--amp"]), ("+ ZeRO", ["--zero"])]
STATE = re.compile(r"\[rank (\d+)\] model state\s+([\d.]+) MiB .*whole model\s+([\d.]+) MiB, ideal 1/(\d+):\s+"
                   r"([\d.]+) MiB")
PEAK = re.compile(r"\[rank (\d+)\] parameters.*peak training memory\s+([\d.]+) MiB")
#: (name, flags): tensor-parallel size 1 is the model without shardtorch's sharding.
STATE_SERIES = [("DDP", ["--group-size", "1"]), ("DDP + shardtorch", []),
                ("FSDP2", ["--group-size", "1", "--fsdp"]), ("FSDP2 + shardtorch", ["--fsdp"])]


def _launch(args, classes, extra, compare):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           PROGRAM, "--device", args.device, "--classes", str(classes), "--steps", str(args.steps),
           "--group-size", str(args.group_size), "--features", str(args.features),
           "--batch-size", str(args.batch_size), "--no-progress", *extra]
    if not compare:
        cmd.append("--no-compare")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd)}):\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout + out.stderr


def run(args, classes, extra, compare):
    output = _launch(args, classes, extra, compare)
    match = LINE.search(output)
    if not match:
        raise RuntimeError(f"no memory summary in the output:\n{output[-3000:]}")
    params, _, peak, unsharded_peak = match.groups()
    return float(peak), float(unsharded_peak) if unsharded_peak else None


def model_state(args, classes, extra):
    """(largest per-rank model state, whole model state, ideal per rank,
    largest per-rank peak), MiB, of one run."""
    output = _launch(args, classes, extra, compare=False)
    states = [(float(h), float(w), float(i)) for _, h, w, _, i in STATE.findall(output)]
    peaks = [float(p) for _, p in PEAK.findall(output)]
    if len(states) != args.nproc or len(peaks) != args.nproc:
        raise RuntimeError(f"expected {args.nproc} model-state and peak lines:\n{output[-3000:]}")
    return max(h for h, _, _ in states), states[0][1], states[0][2], max(peaks)


def state_table(args):
    classes = args.state_classes
    lines = [f"Model state per rank (parameters + gradients + SGD momentum, MiB; the largest rank), "
             f"{args.nproc} {args.device} ranks, {classes:,} classes, {args.features} features; "
             f"tensor-parallel groups of {args.group_size} where shardtorch shards",
             "", "| run | model state per rank | whole model | ideal 1/(dp x tp) | x ideal | peak per rank |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, extra in STATE_SERIES:
        held, whole, ideal, peak = model_state(args, classes, extra)
        lines.append(f"| {name} | {held:.1f} | {whole:.1f} | {ideal:.1f} | {held / ideal:.2f} | {peak:.1f} |")
        print(lines[-1], flush=True)
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4: ZeRO needs data-parallel peers)")
    p.add_argument("--group-size", type=int, default=2, help="tensor-parallel group size (default 2)")
    p.add_argument("--classes", default="25000,50000,100000,200000")
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--state-classes", type=int, default=100000,
                   help="classes of the model-state table (DDP, FSDP2, with and without shardtorch)")
    p.add_argument("--only-state", action="store_true", help="only the model-state table")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "memory_scaling"))
    args = p.parse_args()
    if args.only_state:
        lines = state_table(args)
        print("\n".join(lines))
        return
    classes = [int(c) for c in args.classes.split(",")]
    rows = []
    for c in classes:
        row = {"classes": c}
        row["DDP + shardtorch"], row["DDP"] = run(args, c, [], compare=True)
        for name, extra in SERIES[1:]:
            row[name], _ = run(args, c, extra, compare=False)
        rows.append(row)
        print(row, flush=True)
    names = ["DDP"] + [n for n, _ in SERIES]
    table = [f"Peak training memory per rank (MiB), {args.nproc} {args.device} ranks, tensor-parallel groups of "
             f"{args.group_size}, batch {args.batch_size} per rank, {args.features} features, SGD with momentum",
             "", "| classes | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for row in rows:
        table.append(f"| {row['classes']:,} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |")
    table += [""] + state_table(args)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(table) + "\n")
    print("\n".join(table))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        ax.plot([r["classes"] for r in rows], [r[n] for r in rows], marker="o", label=n)
    ax.set_xlabel("classes")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title(f"{args.nproc} {args.device} ranks, groups of {args.group_size}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    print(f"wrote {args.out}.md and {args.out}.png")


if __name__ == "__main__":
    main()
