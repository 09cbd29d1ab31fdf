"""Placement across nodes: two torchrun agents on this host (--nnodes 2, c10d
rendezvous, 2 processes each) stand for two nodes. A tensor-parallel group of
2 fits a node (ranks 0-1 on node 0, 2-3 on node 1): no warning. A group of 4
spans both: rank 0, and only rank 0, warns once with the layout. The pure rule
is tested on layouts torchrun cannot make here."""
import glob
import json
import os
import sys

from shardtorch.distributed.placement import describe_spanning_groups
from tests.distributed.harness import REPO, free_port
from tests.launcher import run_agents


def _agents(out_dir, group_sizes):
    port = free_port()
    script = os.path.join(REPO, "tests", "distributed", "scripts", "placement.py")
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", node_rank,
                 "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", f"shardtorch-placement-{port}", "--max-restarts", "0", script, out_dir,
                 *group_sizes] for node_rank in (0, 1)]
    results = run_agents(commands, timeout=300, env={"OMP_NUM_THREADS": "1", "SHARDTORCH_TIMEOUT": "120"})
    for node_rank, (code, out) in enumerate(results):
        assert code == 0, f"agent {node_rank} exited {code}:\n{out[-4000:]}"
    reports = []
    for path in sorted(glob.glob(os.path.join(out_dir, "rank*.json"))):
        with open(path) as f:
            reports.extend(json.load(f))
    return reports


def test_two_agents_warn_only_for_groups_that_span_nodes(tmp_path):
    reports = _agents(tmp_path, [2, 4])
    assert sorted((r["rank"], r["group_size"]) for r in reports) == [(rank, g) for rank in range(4) for g in (2, 4)]
    for report in reports:
        if report["group_size"] == 2 or report["rank"] != 0:
            assert report["warnings"] == [], report
    (message,) = next(r["warnings"] for r in reports if r["rank"] == 0 and r["group_size"] == 4)
    assert "1 of 1 tensor-parallel groups of 4 ranks span nodes" in message, message
    assert "{0, 1, 2, 3}" in message and "node 0: ranks 0-1" in message and "node 1: ranks 2-3" in message, message


def test_spanning_groups_are_named_with_the_layout():
    nodes = ["a"] * 3 + ["b"] * 3  # 3 processes per node, groups of 2: {2, 3} spans a and b
    message = describe_spanning_groups(nodes, [[0, 1], [2, 3], [4, 5]])
    assert "1 of 3 tensor-parallel groups of 2 ranks span nodes" in message and "{2, 3}" in message, message
    assert "a: ranks 0-2; b: ranks 3-5" in message and "(3 here)" in message, message
    assert describe_spanning_groups(nodes, [[0, 1, 2], [3, 4, 5]]) is None
    assert describe_spanning_groups(["a", "b", "a", "b"], [[0, 1], [2, 3]]).count("{") == 2  # interleaved nodes
    assert describe_spanning_groups(["a"] * 4, [[0, 1, 2, 3]]) is None
