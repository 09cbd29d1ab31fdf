"""ts.optim.RowSparseSGD / RowSparseAdam against torch's own optimizers, one process.

On one [rows, cols] float32 parameter (default [500000, 512], the weight shard of
a 1M-class head on 2 ranks), side by side, per thread count:

  torch dense        torch.optim.SGD(foreach=True) / Adam(foreach=True), dense gradient
  torch fused dense  torch.optim.SGD(fused=True) / Adam(fused=True), dense gradient
  ours dense         ts.optim.RowSparse*, the same dense gradient
  ours kept K        ts.optim.RowSparse*, a row-sparse gradient of K% of the rows
  before ...         the same two with an earlier implementation of ts.optim
                     (--before FILE: a row_sparse.py, e.g. from `git show
                     main:shardtorch/optim/row_sparse.py > /tmp/before.py`)

SGD: momentum 0.9, weight decay 5e-4; Adam: weight decay 5e-4. Each measurement
builds a fresh optimizer on the shared parameter and gradient, takes one step
(state created, first-step path), then times the second step; the methods take
turns, `--repeats` rounds, median. Ratios are to "torch dense" of the same
thread count. Memory: the parameter, the gradient and one optimizer's state
(plus its temporaries) at a time.

    python benchmarks/optimizer.py [--rows 500000] [--cols 512] [--kept 0.1]
        [--threads 1,2] [--repeats 3] [--kinds sgd,adam] [--before /tmp/before.py]
        [--out FILE.json]
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _load_optim(path):
    spec = importlib.util.spec_from_file_location("_optim_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _methods(kind, ours, before, dense, sparse, kept):
    sgd = dict(lr=0.01, momentum=0.9, weight_decay=5e-4)
    adam = dict(lr=1e-4, weight_decay=5e-4)
    settings = sgd if kind == "sgd" else adam
    torch_cls = torch.optim.SGD if kind == "sgd" else torch.optim.Adam
    name = "RowSparseSGD" if kind == "sgd" else "RowSparseAdam"
    methods = {"torch dense": (lambda p: torch_cls([p], foreach=True, **settings), dense),
               "torch fused dense": (lambda p: torch_cls([p], fused=True, **settings), dense),
               "ours dense": (lambda p: getattr(ours, name)([p], **settings), dense),
               f"ours kept {kept:g}": (lambda p: getattr(ours, name)([p], **settings), sparse)}
    if before is not None:
        methods["before dense"] = (lambda p: getattr(before, name)([p], **settings), dense)
        methods[f"before kept {kept:g}"] = (lambda p: getattr(before, name)([p], **settings), sparse)
    return methods


def _time_second_step(make, param, grad):
    opt = make(param)
    param.grad = grad
    opt.step()  # creates the state; torch's SGD takes its first-step path here
    start = time.perf_counter()
    opt.step()
    elapsed = time.perf_counter() - start
    del opt
    param.grad = None
    return elapsed * 1e3


def measure(rows, cols, kept, threads, repeats, kinds=("sgd", "adam"), before=None):
    """The side-by-side medians (ms) on one [rows, cols] float32 parameter, per
    optimizer kind and thread count; prints each line as it is measured.
    ``before``: an earlier row_sparse module, or None."""
    import shardtorch.optim as ours
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(rows, cols, generator=generator) * 0.01)
    dense = torch.randn(rows, cols, generator=generator)
    kept_rows = torch.randperm(rows, generator=generator)[:int(rows * kept)].sort().values
    # What a sampled ParallelMarginLoss gives its weight: coalesced, sorted rows.
    sparse = torch.sparse_coo_tensor(kept_rows.unsqueeze(0), dense[kept_rows], dense.shape).coalesce()

    results = {"cpu": common.cpu_name(), "torch": torch.__version__, "shape": [rows, cols],
               "kept": kept, "repeats": repeats, "ms": {}}
    threads_before = torch.get_num_threads()
    for n in threads:
        torch.set_num_threads(n)
        for kind in kinds:
            methods = _methods(kind, ours, before, dense, sparse, kept)
            times = {name: [] for name in methods}
            for _ in range(repeats):
                for name, (make, grad) in methods.items():
                    times[name].append(_time_second_step(make, param, grad))
            medians = {name: statistics.median(t) for name, t in times.items()}
            results["ms"][f"{kind} threads={n}"] = medians
            base = medians["torch dense"]
            print(f"{kind} threads={n}: " + ", ".join(
                f"{name} {ms:.1f} ms ({ms / base:.2f}x)" for name, ms in medians.items()), flush=True)
    torch.set_num_threads(threads_before)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=500000)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--kept", type=float, default=0.1)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="sgd,adam", help="optimizers to measure: sgd, adam or both")
    parser.add_argument("--before", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    before = _load_optim(args.before) if args.before else None
    results = measure(args.rows, args.cols, args.kept, [int(t) for t in args.threads.split(",")], args.repeats,
                      kinds=tuple(args.kinds.split(",")), before=before)
    print(f"cpu: {results['cpu']}, torch {results['torch']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
