"""Elastic shrink: four torchrun agents (--nnodes 3:4, one worker each, c10d
rendezvous) train the example; before step 3 one node is lost (its worker
kills its agent, then exits). The three survivors restart, agree on a fresh
rendezvous scope although their agents' restart counts may differ, resume from the
step-2 checkpoint at world size 3 (tensor-parallel 3, resharded model and
optimizer state) and end with the parameters of the reference trajectory:
4 ranks to step 2, saved, resumed on 3 ranks to the end (float64, 1e-12).
It is also the test of agents on several nodes training together: rank 0 logs
every step and each of the final world's ranks prints its summary once."""
import re
import sys

import torch

from tests.distributed.harness import free_port, run_script
from tests.distributed.test_train_classifier import PROGRAM, SMALL
from tests.launcher import run_agents

RUN = [*SMALL, "--dtype", "float64", "--steps", "5"]


def test_lost_node_restarts_smaller_and_matches_the_reference(tmp_path):
    for code, output in run_script(PROGRAM, 4, [*RUN, "--steps", "2", "--save", tmp_path / "ref"], timeout=600):
        assert code == 0, output[-4000:]
    reference = tmp_path / "reference.pt"
    for code, output in run_script(PROGRAM, 3, [*RUN, "--resume", tmp_path / "ref", "--dump-params", reference],
                                   timeout=600):
        assert code == 0, output[-4000:]

    port = free_port()
    elastic = tmp_path / "elastic.pt"
    commands = []
    for node in range(4):
        # Node 0 hosts the rendezvous store; node 3 is the one lost.
        fault = ["--fail-at-step", "3", "--fail-rank", "-1", "--fail-kills-agent"] if node == 3 else []
        commands.append([sys.executable, "-m", "torch.distributed.run", "--nnodes", "3:4", "--nproc-per-node", "1",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                         f"shrink-{port}", "--rdzv-conf",
                         f"is_host={'true' if node == 0 else 'false'},last_call_timeout=5",
                         "--max-restarts", "3", PROGRAM, *RUN, "--save", tmp_path / "elastic",
                         "--save-every", "2", "--auto-resume", "--dump-params", elastic, *fault])
    results = run_agents(commands, timeout=900, env={"OMP_NUM_THREADS": "1", "SHARDTORCH_TIMEOUT": "60"})
    codes, outputs = [code for code, _ in results], [out for _, out in results]
    assert codes[3] == -9, f"node 3 was not lost:\n{outputs[3][-3000:]}"
    # (Spare restarts: on a loaded host the first re-rendezvous may still count the lost node.)
    for node in range(3):
        assert codes[node] == 0, f"agent {node} exited {codes[node]}:\n{outputs[node][-5000:]}"
    expected, resumed = torch.load(reference), torch.load(elastic)
    assert expected.keys() == resumed.keys()
    for part in expected:
        for key, value in expected[part].items():
            other = resumed[part][key]
            assert other.shape == value.shape, (part, key)
            difference = (other.double() - value.double()).abs().max().item() if value.numel() else 0.0
            assert difference <= 1e-12, f"{part}.{key} differs by {difference} after the shrink"
    # Rank 0 (of either world) logged every step; every rank of the final world printed its summary.
    survivors = "".join(outputs[:3])
    steps = re.findall(r"^step (\d+)/5 loss ([0-9.]+) acc [0-9.]+ top5 [0-9.]+ samples/s \d+", survivors, re.M)
    assert {int(step) for step, _ in steps} == {1, 2, 3, 4, 5}, survivors[-4000:]
    assert all(float(loss) > 0 for _, loss in steps)
    summaries = re.findall(r"^\[rank (\d)\] parameters .+ \(unsharded .+, ([0-9.]+)x\); peak training memory .+$",
                           survivors, re.M)
    assert sorted(rank for rank, _ in summaries) == ["0", "1", "2"], survivors[-4000:]
    assert all(float(factor) > 1.0 for _, factor in summaries), summaries  # the sharded head holds less
    # It trained past the checkpoint: step 2's head is not the final one.
    saved = torch.load(tmp_path / "ref" / "step-2" / "head.pt")
    assert not torch.equal(saved["weight"], expected["head"]["weight"])
