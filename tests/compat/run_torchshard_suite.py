"""Runs TorchShard's own unit tests and projects on shardtorch and reports,
for each, whether it ran and passed.

    python tests/compat/run_torchshard_suite.py TORCHSHARD_CHECKOUT [--only NAME ...]

TORCHSHARD_CHECKOUT is a checkout of TorchShard's public repository
(KaiyuYue/torchshard). Its tests/ and projects/ are copied to a temporary
folder with one change, ``import torchshard as ts`` -> ``import shardtorch as ts``
(its own package is not copied, so nothing else can be imported), and run on
CPU with 2 processes over Gloo through tests/compat/torchshard_on_cpu
(``.cuda()`` is the identity, NCCL is Gloo; see its docstring), at small sizes
and few steps given on the projects' own command lines. Needs torchvision for
the projects (e.g. ``pip install --no-deps --target DIR torchvision==<the
one for this torch>`` and ``PYTHONPATH=DIR``). Not part of the pytest suite:
it needs TorchShard's source, which this repository does not hold.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SHIM = os.path.join(HERE, "torchshard_on_cpu")

UNIT_TESTS = [  # (module, class, tests): TorchShard's 17
    ("test_cross_entropy", "TestCrossEntropy", ["test_naive_cross_entropy"]),
    ("test_layers", "TestLayers", ["test_naive_col_parallel_linear", "test_naive_row_parallel_linear",
                                   "test_naive_parallel_embedding"]),
    ("test_modules", "TestLayers", ["test_parallel_self_attention", "test_parallel_mlp",
                                    "test_parallel_transformer_block"]),
    ("test_nn", "TestParallelCrossEntropy", ["test_parallel_cross_entropy",
                                             "test_parallel_cross_entropy_within_ddp_mode",
                                             "test_parallel_cross_entropy_within_ddp_mode_and_row_parallel",
                                             "test_parallel_cross_entropy_within_ddp_mode_and_col_parallel"]),
    ("test_nn", "TestParallelLinearStack", ["test_parallel_linear_stack"]),
    ("test_nn", "TestParallelLinear", ["test_col_parallel_linear", "test_raw_parallel_linear",
                                       "test_row_parallel_linear"]),
    ("test_serialization", "TestSerialization", ["test_0_save_model_state_dict", "test_1_load_model_state_dict"]),
]


def _copy_with_import_changed(source: str, target: str) -> None:
    for part in ("tests", "projects"):
        shutil.copytree(os.path.join(source, part), os.path.join(target, part))
    for root, _, files in os.walk(target):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(text.replace("import torchshard as ts", "import shardtorch as ts"))


def _make_images(root: str, classes: int, per_class: int, size: int) -> None:
    from PIL import Image
    import numpy as np
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            folder = os.path.join(root, split, f"class{c:03d}")
            os.makedirs(folder, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))


def _run(command, cwd, env, timeout):
    start = time.time()
    try:
        done = subprocess.run(command, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, output = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace")
    return code, output, time.time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("torchshard", help="a checkout of TorchShard's repository")
    parser.add_argument("--only", nargs="*", default=None, help="names of tests or projects to run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="torchshard-on-shardtorch-")
    _copy_with_import_changed(args.torchshard, work)
    env = dict(os.environ, TORCHSHARD_RANKS="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([SHIM, REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    python = sys.executable
    results = []

    def wanted(name):
        return args.only is None or any(o in name for o in args.only)

    for module, cls, tests in UNIT_TESTS:
        for test in tests:
            name = f"{module}.{test}"
            if not wanted(name):
                continue
            code, output, seconds = _run([python, "-m", "unittest", f"{module}.{cls}.{test}"],
                                         os.path.join(work, "tests"), env, args.timeout)
            results.append((name, code, seconds, output))

    data = os.path.join(work, "data")
    projects = {
        "imagenet": ("projects/imagenet", [
            "main.py", data, "-a", "resnet18", "--epochs", "1", "-b", "4", "-j", "0", "--lr", "0.01",
            "--world-size", "1", "--rank", "0", "--dist-url", "tcp://127.0.0.1:{port}", "--dist-backend", "gloo",
            "--multiprocessing-distributed", "--enable-model-parallel", "--model-parallel-dim", "1",
            "--num-classes", "6", "-p", "1"], {}),
        "arcface": ("projects/arcface", [
            "main.py", data, "-a", "iresnet18", "--epochs", "1", "-b", "4", "-j", "0", "--lr", "0.01",
            "--world-size", "1", "--rank", "0", "--dist-url", "tcp://127.0.0.1:{port}", "--dist-backend", "gloo",
            "--multiprocessing-distributed", "--enable-model-parallel", "--model-parallel-dim", "1",
            "--num-classes", "6", "-p", "1"], {}),
        "minGPT": ("projects/minGPT", [
            "main.py", data, "--epochs", "1", "-b", "4", "-j", "0", "--world-size", "1", "--rank", "0",
            "--dist-url", "tcp://127.0.0.1:{port}", "--dist-backend", "gloo", "--multiprocessing-distributed",
            "--enable-model-parallel", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "-p", "1"],
            {"TORCHSHARD_FAKE_CIFAR": "1", "TORCHSHARD_FAKE_CIFAR_SIZE": "8"}),
    }
    if any(wanted(n) for n in projects):
        _make_images(data, classes=6, per_class=2, size=112)
        import torch
        torch.manual_seed(0)
        torch.save(torch.rand(16, 3) * 2 - 1, os.path.join(work, "projects", "minGPT", "c.pt"))
    for port, (name, (folder, command, extra)) in enumerate(projects.items(), start=29500):
        if not wanted(name):
            continue
        command = [python] + [c.format(port=port) for c in command]
        code, output, seconds = _run(command, os.path.join(work, folder), dict(env, **extra), args.timeout)
        results.append((f"projects/{name}", code, seconds, output))

    for name, code, seconds, output in results:
        print(f"=== {name}: {'passed' if code == 0 else f'FAILED ({code})'} in {seconds:.0f} s")
        if code != 0:
            print(output[-3000:])
    print("\nsummary:")
    for name, code, seconds, _ in results:
        print(f"  {name:70s} {'passed' if code == 0 else 'FAILED'}")
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(code == 0 for _, code, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
