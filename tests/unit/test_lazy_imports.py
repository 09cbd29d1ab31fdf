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
