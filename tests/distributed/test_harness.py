"""The harness reports every case of a shared launch, even past a crash: a case
that kills a rank fails with that rank's exit code, and the cases after it run
in a new launch instead of vanishing (harness.launch_modules)."""
import pytest

from tests.distributed import harness
from tests.distributed.harness import launch, launch_modules

MODULE = "tests.distributed.cases_harness"
OTHER = "tests.distributed.cases_linear"  # a second module in the same launch, run after MODULE


def test_a_crash_fails_its_case_and_the_others_still_run():
    results = launch_modules({MODULE: None, OTHER: ["case_layer_matches_nn_linear_float64"]},
                             2, init=True, keep_going=True, timeout=120)
    ours = results[MODULE]
    assert ours["case_a_passes"] is None and ours["case_d_runs_after_the_crash"] is None, ours
    assert ours["case_b_fails_on_rank_1"].startswith("rank 1: ") and "on purpose" in ours["case_b_fails_on_rank_1"]
    crash = ours["case_c_kills_rank_1"]
    assert "rank 1 of " in crash and "exited with 23 while running " + MODULE + ".case_c_kills_rank_1" in crash, crash
    assert list(results[OTHER].values()) == [None], results[OTHER]
    # --case-durations: both launches (the crash ends the first) and each case that finished, once.
    launches = harness.LAUNCH_TIMES[-2:]
    timed = [case for launch in launches for (_, case) in launch["cases"]]
    finished = ["case_a_passes", "case_b_fails_on_rank_1", "case_d_runs_after_the_crash",
                "case_layer_matches_nn_linear_float64"]
    assert sorted(set(timed) - {"case_c_kills_rank_1"}) == sorted(finished) and len(set(timed)) == len(timed), launches
    assert all(launch["seconds"] >= sum(launch["cases"].values()) / 2 > 0 for launch in launches), launches
    report = "\n".join(harness.case_durations_report(0))
    assert "cases_harness.case_d_runs_after_the_crash [2x2]" in report and "first after" in report, report


def test_launch_alone_raises_on_a_crash():
    with pytest.raises(RuntimeError, match="exited with 23"):
        launch(MODULE, 2, cases=["case_c_kills_rank_1"], timeout=120)


def test_cases_that_init_themselves_start_together():
    results = launch_modules({"tests.distributed.cases_harness_rendezvous": None}, 2, init=False, timeout=120,
                             env={"SHARDTORCH_TIMEOUT": "20"})
    assert all(error is None for error in results["tests.distributed.cases_harness_rendezvous"].values()), results
