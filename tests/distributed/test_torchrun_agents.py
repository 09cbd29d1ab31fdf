"""Two torchrun agents (--nnodes 2, one process each, c10d rendezvous on this
host) train the example classifier together: both finish with exit 0, rank 0
logs every step and each rank prints its summary line."""
import os
import re
import subprocess
import sys

from tests.distributed.harness import REPO, free_port

STEPS = 3


def test_two_torchrun_agents_train_the_example_together():
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDTORCH_TIMEOUT="120",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    agents = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"shardtorch-agents-{port}", "--max-restarts", "0",
               os.path.join(REPO, "examples", "python", "train_classifier.py"),
               "--steps", str(STEPS), "--classes", "1000", "--no-progress", "--no-compare"]
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=400)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    for node_rank, (agent, out) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"agent {node_rank} exited {agent.returncode}:\n{out[-4000:]}"
    # One process per agent: node 0 hosts global rank 0, node 1 rank 1.
    steps = re.findall(r"^step (\d+)/%d loss ([0-9.]+) acc ([0-9.]+) top5 [0-9.]+ samples/s \d+" % STEPS, outputs[0], re.M)
    assert [int(s) for s, _, _ in steps] == list(range(1, STEPS + 1)), outputs[0][-4000:]
    assert all(float(loss) > 0 for _, loss, _ in steps)
    for node_rank, out in enumerate(outputs):
        summary = re.findall(r"^\[rank (\d)\] parameters .+ \(unsharded .+, ([0-9.]+)x\); peak training memory .+$",
                             out, re.M)
        assert summary == [(str(node_rank), summary[0][1])] if summary else False, out[-4000:]
        assert float(summary[0][1]) > 1.0, summary  # the sharded head holds fewer parameters
