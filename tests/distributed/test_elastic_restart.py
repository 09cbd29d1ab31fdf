"""Elastic restart: under torchrun --max-restarts, a run one of whose ranks is
killed mid-training restarts, resumes from its last checkpoint and ends with
exactly the parameters of an uninterrupted run (float64, bitwise)."""
import os
import subprocess
import sys

import torch

from tests.distributed.harness import REPO, free_port, run_script
from tests.distributed.test_train_classifier import PROGRAM, SMALL

RUN = [*SMALL, "--dtype", "float64", "--steps", "6", "--save-every", "2"]


def test_killed_rank_resumes_and_ends_bitwise_equal(tmp_path):
    straight = tmp_path / "straight.pt"
    for code, output in run_script(PROGRAM, 2, [*RUN, "--save", tmp_path / "a", "--dump-params", straight],
                                   timeout=600):
        assert code == 0, output[-4000:]

    elastic = tmp_path / "elastic.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           PROGRAM, *map(str, RUN), "--save", str(tmp_path / "b"), "--auto-resume",
           "--fail-at-step", "3", "--fail-rank", "1", "--dump-params", str(elastic)]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "exitcode: 17" in output, \
        "the injected failure did not happen:\n" + output[-3000:]

    expected, resumed = torch.load(straight), torch.load(elastic)
    assert expected.keys() == resumed.keys()
    for part in expected:
        assert expected[part].keys() == resumed[part].keys()
        for key, value in expected[part].items():
            assert torch.equal(value, resumed[part][key]), f"{part}.{key} differs after the restart"
