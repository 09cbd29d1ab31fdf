"""Data x tensor parallel training (ts.nn.parallel, ts.random, the group
sampler) in real multi-process runs: world 4 as 2 x 2 and as one group of 4.

Run with -s to see the largest parameter error of each layout."""
import json
import os

from tests.distributed.cases_data_parallel import REPORT_FILE
from tests.distributed.harness import case_tests, reads_launch, scratch_dir

MODULE = "tests.distributed.cases_data_parallel"

test_data_parallel = case_tests(MODULE, world_size=4, group_size=(2, 4))


@reads_launch(MODULE, 4, 2)
@reads_launch(MODULE, 4, 4)
def test_largest_parameter_error_per_layout(launches):
    for group_size in (2, 4):
        launches.get(MODULE, 4, group_size)
    worst = {}
    # Ranks append one JSON line per training run to the session's report.
    with open(os.path.join(scratch_dir(), REPORT_FILE)) as f:
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
