"""The catalogue of bad inputs (docs/bad_inputs.md): every entry raises the
documented exception with the documented message on every rank (one 2-rank
launch runs them all). Calls before init, a
group_size that does not divide the world and the gather that leaves a peer
waiting need their own processes (scripts/bad_setup.py)."""
import json
import os
import tempfile

import pytest

from tests.distributed import cases_bad_inputs
from tests.distributed.harness import REPO, reads_launch, run_script

MODULE = "tests.distributed.cases_bad_inputs"
SCRIPT = os.path.join(REPO, "tests", "distributed", "scripts", "bad_setup.py")


@pytest.mark.parametrize("name", sorted(cases_bad_inputs.ENTRIES))
@reads_launch(MODULE, 2, cases=lambda params: ["case_" + params["name"]])
def test_bad_input_gets_a_clear_error_on_every_rank(launches, name):
    results = launches.get(MODULE, 2, cases=["case_" + name])
    assert results["case_" + name] is None, results["case_" + name]


def _per_rank(mode, *args, world_size=2):
    # Ranks that are all done with their calls need not wait out the timeout (bad_setup.py).
    with tempfile.TemporaryDirectory() as done_dir:
        runs = run_script(SCRIPT, world_size, [mode, *args], timeout=120, env={"BAD_SETUP_DONE_DIR": done_dir})
    lines = []
    for rc, out in runs:
        parsed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert rc == 0 and len(parsed) == 1, out[-3000:]
        lines.append(parsed[0])
    return lines


def test_calls_before_init_fail_on_every_rank():
    for line in _per_rank("before_init"):
        results = line["results"]
        assert set(results) == {"get_group_size", "parallel_linear_module", "reduce_op", "cross_entropy"}
        for name, error in results.items():
            assert error is not None, f"rank {line['rank']}: {name} ran before init"
            assert error.startswith("RuntimeError: ") and "init_process_group(group_size=...) first" in error, error
        assert "not initialised" in results["parallel_linear_module"]
        assert "no process group is initialised (group 'tp' requested)" in results["reduce_op"]


def test_group_size_that_does_not_divide_the_world_fails_on_every_rank_and_leaves_nothing():
    for line in _per_rank("indivisible"):
        results = line["results"]
        assert results["init"] == ("ValueError: init_process_group: group_size must divide the world size 2, "
                                   "got 3"), results
        assert results["is_initialized_after"] is None
        assert results["init_again"] is None and results["reduce_after"] is None, results


def test_gather_full_size_that_fits_some_ranks_only_fails_on_every_rank_at_once():
    """Was known gap G5: the rank whose shard fitted entered the all-gather and
    waited for the timeout. The ranks now compare what they hold first."""
    timeout = 8.0
    for line in _per_rank("full_size", timeout):
        error = line["results"]["gather_replicated"]
        assert error is not None and "full_size=7" in error, f"rank {line['rank']}: {error}"
        assert "rank 0 holds 3 instead of 4" in error, error
        error = line["results"]["different_full_size"]
        assert error is not None and "different full_size values [7, 8]" in error, f"rank {line['rank']}: {error}"
        assert line["seconds"] < timeout / 2, f"rank {line['rank']} waited {line['seconds']:.1f} s"


def test_loss_target_out_of_range_on_one_rank_fails_on_every_rank_at_once():
    """Targets should agree across the group; when one rank's do not and are
    out of range there, its failure travels with the loss's statistics and
    every rank raises, instead of the others waiting for the timeout."""
    timeout = 8.0
    for line in _per_rank("target_one_rank", timeout):
        for name in ("plain", "fused"):
            error = line["results"][name]
            assert error is not None, f"rank {line['rank']} {name}: no error"
            if line["rank"] == 1:
                assert "target values must be in [0, num_classes=11)" in error and "got 99" in error, error
            else:
                assert "group rank 1 failed a check: a target value out of range" in error, error
        assert line["seconds"] < timeout / 2, f"rank {line['rank']} waited {line['seconds']:.1f} s"


def test_row_parallel_one_feature_scattered_input():
    """Was known gap G6: ts.distributed.scatter marks its output as sharded, so a
    row-parallel layer of 1 input feature reads rank 0's shard (the whole
    feature) as a shard and every rank runs the same collectives."""
    timeout = 8.0
    for line in _per_rank("row_one", timeout):
        assert line["results"]["forward_backward"] is None, f"rank {line['rank']}: {line['results']}"
        assert line["seconds"] < timeout - 2, f"rank {line['rank']} waited {line['seconds']:.1f} s"
