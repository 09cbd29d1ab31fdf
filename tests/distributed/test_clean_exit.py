"""Jobs that end without destroy_process_group exit with the script's own code, never SIGABRT.

Before shardtorch waited for Gloo's worker threads at exit (shardtorch/distributed/clean_exit.py),
a rank of a job like tests/distributed/scripts/exit_without_teardown.py died at exit with
"terminate called without an active exception" in 5 of 6 six-rank torchrun launches on this
project's 2-core machine (torch 2.14.1): each launch here would fail alone with high
probability, all three together almost surely. Real launchers, fresh interpreters: the race is
between a fresh process's exit and its threads, which forked ranks do not show."""
import os
import subprocess
import sys

import pytest

from tests.distributed.harness import REPO, free_port

SCRIPT = os.path.join(REPO, "tests", "distributed", "scripts", "exit_without_teardown.py")


def _env(world=None, port=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    if world is not None:
        env.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _torchrun(world, group_size, mode):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           SCRIPT, mode, str(group_size)]
    done = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("world,group_size,mode", [(6, 3, "ok"), (6, 2, "ok"), (4, 2, "exit")])
def test_torchrun_sees_the_scripts_exit_code(world, group_size, mode):
    code, output = _torchrun(world, group_size, mode)
    assert "terminate called" not in output and "SIGABRT" not in output, output[-4000:]
    if mode == "ok":
        assert code == 0, output[-4000:]
        assert output.count(f"all-reduced {world}\n") == world, output[-4000:]
    else:  # rank 0 ended with sys.exit(3): torchrun names that code and no other failure
        assert code != 0
        assert "exitcode  : 3" in output, output[-4000:]
        assert "exitcode  : -" not in output.replace("exitcode  : -15", ""), output[-4000:]


def test_spawned_rank_that_raised_exits_with_its_error():
    world = 3
    done = subprocess.run([sys.executable, SCRIPT, "raise", str(world), "spawn"], env=_env(world, free_port()),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert "terminate called" not in output and "SIGABRT" not in output, output[-4000:]
    assert done.returncode == 1, output[-4000:]
    assert "this rank fails on purpose" in output, output[-4000:]
