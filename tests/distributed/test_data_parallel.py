"""Data x tensor parallel training (ts.nn.parallel, ts.random, the group
sampler) in real multi-process runs: world 4 as 2 x 2 and as one group of 4.

Run with -s to see the largest parameter error of each layout."""
import json
import os
import tempfile

from tests.distributed.harness import case_tests

MODULE = "tests.distributed.cases_data_parallel"
# One report file per pytest process; ranks append one JSON line per training run.
REPORT = os.path.join(tempfile.gettempdir(), f"shardtorch-data-parallel-{os.getpid()}.jsonl")
ENV = {"SHARDTORCH_DTP_REPORT": REPORT}
if os.path.exists(REPORT):  # a previous process with the same id
    os.remove(REPORT)


test_data_parallel = case_tests(MODULE, world_size=4, group_size=(2, 4), env=ENV)


def test_largest_parameter_error_per_layout(launches):
    for group_size in (2, 4):
        launches.get(MODULE, 4, group_size, env=ENV)
    worst = {}
    with open(REPORT) as f:
        for line in f:
            run = json.loads(line)
            if run["autocast"] != "None":
                continue  # low-precision runs are compared by their updates, separately
            key = (f"{run['layout']} world={run['world']} group_size={run['group_size']}", run["dtype"])
            worst[key] = max(worst.get(key, 0.0), run["max_relative_error"])
    print("\nlargest relative parameter error after training, per layout:")
    for (layout, dtype), error in sorted(worst.items()):
        print(f"  {layout:32s} {dtype:14s} {error:.3e}")
    assert {layout for layout, _ in worst} == {"hybrid world=4 group_size=2", "hybrid world=4 group_size=4",
                                               "2d world=4 group_size=2", "2d world=4 group_size=4"}
    for (layout, dtype), error in worst.items():
        assert error <= (1e-9 if dtype == "torch.float64" else 1e-5), (layout, dtype, error)
