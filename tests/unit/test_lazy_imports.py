"""``import shardtorch`` leaves torch.distributed.tensor, torch.distributed.fsdp
and torch.distributed.checkpoint unimported (0.7 s of every process's
start: utils/fsdp_detection.py), and the DTensor / FSDPModule checks still
find the classes once something has imported them."""
import subprocess
import sys

from tests.launcher import REPO

HEAVY = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_shardtorch_leaves_dtensor_fsdp_and_dcp_unimported():
    out = _run(f"import sys, shardtorch\nprint([m for m in {HEAVY!r} if m in sys.modules])")
    assert out == "[]", f"import shardtorch imported {out}"


def test_the_checks_find_the_classes_once_imported():
    out = _run(
        "import torch\n"
        "from shardtorch.utils.fsdp_detection import _loaded_class, is_dtensor, is_fsdp_module\n"
        "before = (_loaded_class('torch.distributed.tensor', 'DTensor'), is_dtensor(torch.ones(1)),\n"
        "          is_fsdp_module(torch.nn.Linear(1, 1)))\n"
        "from torch.distributed.tensor import DTensor\n"
        "from torch.distributed.fsdp import FSDPModule\n"
        "after = (_loaded_class('torch.distributed.tensor', 'DTensor') is DTensor,\n"
        "         _loaded_class('torch.distributed.fsdp', 'FSDPModule') is FSDPModule,\n"
        "         is_dtensor(torch.ones(1)), is_fsdp_module(torch.nn.Linear(1, 1)))\n"
        "print(before, after)")
    assert out == "(None, False, False) (True, True, False, False)", out


def test_what_imports_them_at_first_use_works_in_a_fresh_interpreter(tmp_path):
    """save_dcp / load_dcp (with optimizer state) and ts.nn.parallel.fully_shard import DCP and FSDP
    themselves: in the suite's ranks, forked from servers that imported them already
    (tests/fork_server.py, configuring shardtorch/utils/fork_server.py), a missing import would go unseen; here nothing else imports them."""
    out = _run(
        "import os, sys, tempfile, torch, torch.distributed as dist\n"
        "import shardtorch as ts\n"
        f"heavy = {HEAVY!r}\n"
        "fd, store = tempfile.mkstemp(); os.close(fd); os.unlink(store)\n"
        "dist.init_process_group('gloo', store=dist.FileStore(store, 1), rank=0, world_size=1)\n"
        "ts.distributed.init_process_group(group_size=1)\n"
        "assert not [m for m in heavy if m in sys.modules]\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(ts.nn.ParallelLinear(4, 6, dim=1), torch.nn.ReLU())\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "model(torch.randn(3, 4)).sum().backward(); optimizer.step()\n"
        f"ts.checkpoint.save_dcp(model, {str(tmp_path / 'ckpt')!r}, optimizer=optimizer)\n"
        "saved = {k: v.clone() for k, v in model.state_dict().items()}\n"
        "with torch.no_grad():\n"
        "    for p in model.parameters(): p.zero_()\n"
        f"ts.checkpoint.load_dcp(model, {str(tmp_path / 'ckpt')!r}, optimizer=optimizer)\n"
        "assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())\n"
        "ts.nn.parallel.fully_shard(model)\n"
        "model(torch.randn(3, 4)).sum().backward()\n"
        "print(sorted(m for m in heavy if m in sys.modules))")
    assert out == str(sorted(HEAVY)), out
