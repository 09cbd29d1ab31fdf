"""When the argument checks that NCCL collectives carry give their verdict (comm::DeferredChecks,
docs/cuda.md "Errors without host synchronisation"), driven on CPU with fake copies whose readiness
the test decides, as a GPU ahead of or behind its host would: a check made after a group's L-th
launch is given just before launch L + lag, waiting then only if its copy is not ready, so that the
host runs up to `lag` collectives ahead of the GPU without blocking, and every rank raises at the
same launch whatever its GPU's progress; ts.distributed.check_deferred and destroy_process_group
give what is left."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

import shardtorch as ts
from shardtorch import _C
from tests.doubles import _C_testing

LAG = _C._DEFERRED_CHECK_LAG
ROOT = pathlib.Path(__file__).parents[2]


def test_the_lag_lets_the_host_run_several_collectives_ahead():
    assert LAG == 8 == _C_testing._FakeDeferredChecks().lag


def test_launches_within_the_lag_never_wait_for_a_pending_check():
    checks = _C_testing._FakeDeferredChecks()
    checks.before_launch()                # the collective whose values are checked
    checks.add([0.0, 0.0], ready=False)   # the GPU has not copied them yet
    for _ in range(LAG - 1):
        checks.before_launch()            # would block on the copy if it were read here
    assert checks.counts == {"launches": LAG, "pending": 1, "settled": 0, "waits": 0, "dropped": 0}
    checks.before_launch()                # launch 1 + LAG: due; still not ready, so it waits
    assert checks.counts == {"launches": LAG + 1, "pending": 0, "settled": 1, "waits": 1, "dropped": 0}


def test_a_check_is_waited_for_only_if_its_copy_is_not_ready_when_due():
    checks = _C_testing._FakeDeferredChecks()
    for ordinal in range(1, 4 * LAG + 1):
        checks.before_launch()
        checks.add([0.0], ready=False)
        # The GPU finishes each copy half the lag later: in time.
        if ordinal > LAG // 2:
            checks.set_ready(ordinal - 1 - LAG // 2)
    counts = checks.counts
    assert counts["settled"] == 3 * LAG and counts["pending"] == LAG and counts["waits"] == 0, counts


def test_a_failed_check_raises_at_the_lagth_launch_not_when_its_copy_is_ready():
    checks = _C_testing._FakeDeferredChecks()
    checks.before_launch()
    checks.add([0.0, 3.0], ready=True)    # ready at once: still not raised before its launch
    for _ in range(LAG - 1):
        checks.before_launch()
    with pytest.raises(RuntimeError, match="fake check 0 failed"):
        checks.before_launch()
    checks.before_launch()                # given once: the next launch goes
    assert checks.counts["pending"] == 0


def _program(checks, bad_at, launches, ready_after):
    """A rank's collectives: each launch's values checked (bad after launch `bad_at`), its copy
    ready `ready_after` launches later (None: never before it is due). Returns the launch that
    raised and its message."""
    made = []
    for ordinal in range(1, launches + 1):
        try:
            checks.before_launch()
        except RuntimeError as error:
            return ordinal, str(error).splitlines()[0]
        made.append(checks.add([1.0 if ordinal == bad_at else 0.0], ready=ready_after == 0))
        if ready_after:
            for i in made[:max(0, len(made) - ready_after)]:
                checks.set_ready(i)
    try:
        checks.settle_all()
    except RuntimeError as error:
        return "end", str(error).splitlines()[0]
    return None, None


@pytest.mark.parametrize("bad_at", [1, 5, 13])
def test_every_simulated_rank_raises_at_the_same_launch_whatever_its_gpus_pace(bad_at):
    # Ranks whose GPUs finish each copy at once, 3 launches later, LAG launches later, or
    # never in time (the host waits): the same gathered values, the same verdict, the same launch.
    paces = [0, 3, LAG, None]
    raised = [_program(_C_testing._FakeDeferredChecks(), bad_at, launches=40, ready_after=pace) for pace in paces]
    assert raised == [(bad_at + LAG, f"fake check {bad_at - 1} failed")] * len(paces), raised


def test_a_check_after_the_last_launch_is_given_by_settle_all():
    checks = [_C_testing._FakeDeferredChecks() for _ in range(3)]
    for rank, rank_checks in enumerate(checks):
        raised = _program(rank_checks, bad_at=20, launches=20, ready_after=rank)
        assert raised == ("end", "fake check 19 failed"), (rank, raised)
        assert rank_checks.counts["pending"] == 0


def test_every_due_check_is_given_even_when_one_fails():
    checks = _C_testing._FakeDeferredChecks(lag=2)
    checks.before_launch()
    checks.add([5.0])        # two checks on one collective, both bad
    checks.add([6.0])
    checks.before_launch()
    with pytest.raises(RuntimeError, match="fake check 0 failed"):
        checks.before_launch()
    assert checks.counts["pending"] == 0
    checks.before_launch()   # neither comes again


def test_a_rank_that_left_is_told_even_when_another_failure_comes_first():
    # The first failure is raised as it is; the departure comes after it under its own error,
    # never pinned on the first (which is no rank's departure).
    checks = _C_testing._FakeDeferredChecks(lag=1)
    checks.before_launch()
    checks.add([1.0])                    # found on the device
    checks.add([2.0], a_rank_left=True)  # a rank raised alone: the peers must abort
    with pytest.raises(RuntimeError, match=r"^fake check 0 failed \(then a rank left: fake check 1 failed\)$"):
        checks.before_launch()
    assert checks.events == ["wait 0", "wait 1", "abort"]
    checks.before_launch()
    checks.add([0.0], a_rank_left=True)  # passed: nothing to tell
    checks.before_launch()


def test_the_lag_must_be_positive():
    with pytest.raises(RuntimeError, match="lag must be at least 1, got 0"):
        _C_testing._FakeDeferredChecks(lag=0)


def test_the_nccl_communicator_defers_its_checks_by_this_rule():
    # The rule above runs on CPU; this ties it to the NCCL communicator, which only runs on a GPU.
    source = (ROOT / "csrc" / "comm" / "nccl_communicator.cpp").read_text()
    raise_if = source[source.index("void raise_if("):]
    raise_if = raise_if[:raise_if.index("\n  }\n")]
    assert "deferred_checks_.add(" in raise_if and "synchronize" not in raise_if.replace("copied->synchronize", "")
    enqueue = source[source.index("std::shared_ptr<CommHandle> enqueue("):]
    enqueue = enqueue[:enqueue.index("\n  }\n")]
    assert "deferred_checks_.before_launch()" in enqueue
    # Settled before the device's launch lock is taken: a wait never holds up other groups.
    assert enqueue.index("deferred_checks_.before_launch()") < enqueue.index("with_device_launch_lock")
    assert "synchronize" not in enqueue
    assert "DeferredChecks deferred_checks_;" in source


def test_after_a_verdict_that_a_rank_left_the_host_aborts_first_and_waits_for_no_copy():
    # A rank raised alone at the collective of check 0 (every rank joined that one, so its copy
    # arrives); the collectives launched after it wait for that rank forever, and so would the
    # copies behind them. check_deferred (settle_all) must abort first and read none of them.
    checks = _C_testing._FakeDeferredChecks()
    checks.before_launch()
    checks.add([1.0], a_rank_left=True)          # not on the host yet, but it will arrive
    for _ in range(3):
        checks.before_launch()
        checks.add([0.0], arrives=False)         # behind a collective the rank that left never joins
    with pytest.raises(RuntimeError, match=r"^fake check 0 failed \(a rank left\)"):
        checks.settle_all()
    assert checks.events == ["wait 0", "abort"]
    assert checks.counts["pending"] == 0 and checks.counts["dropped"] == 3, checks.counts
    checks.settle_all()                           # nothing left to give


def test_a_rank_left_verdict_at_a_launch_drops_the_copies_queued_behind_it():
    # The same verdict given at its LAG-th launch: the checks made since are never waited for,
    # neither then nor at the launches after it.
    checks = _C_testing._FakeDeferredChecks()
    checks.before_launch()
    checks.add([2.0], a_rank_left=True, ready=True)
    for _ in range(LAG - 1):
        checks.before_launch()
        checks.add([0.0], arrives=False)
    with pytest.raises(RuntimeError, match=r"^fake check 0 failed \(a rank left\)"):
        checks.before_launch()
    assert checks.events == ["abort"] and checks.counts["dropped"] == LAG - 1, checks.counts
    checks.add([0.0], arrives=False)             # after the abort: dropped at once
    for _ in range(LAG + 1):
        checks.before_launch()
    checks.settle_all()
    assert checks.events == ["abort"] and checks.counts["dropped"] == LAG, checks.counts


def test_a_poll_aborts_at_once_on_a_ready_verdict_that_a_rank_left():
    # The watchdog's poll, between launches (a backward's all-reduce in flight): the verdict that
    # a rank left is read as soon as its copy is ready and aborts now, not at its LAG-th launch;
    # the next launch raises it; the copies behind it are never waited for.
    checks = _C_testing._FakeDeferredChecks()
    checks.before_launch()
    checks.add([0.0], ready=True)                # passed
    checks.before_launch()
    checks.add([3.0], a_rank_left=True)          # not on the host yet
    checks.before_launch()
    checks.add([0.0], arrives=False)             # behind a collective the rank that left never joins
    checks.poll()
    assert checks.events == [] and checks.counts["pending"] == 3   # stops at a copy not ready
    checks.set_ready(1)
    checks.poll()
    assert checks.events == ["abort"], checks.events
    assert checks.counts == {"launches": 3, "pending": 0, "settled": 2, "waits": 0, "dropped": 1}
    with pytest.raises(RuntimeError, match=r"^fake check 1 failed \(a rank left\)"):
        checks.before_launch()
    checks.before_launch()                       # given once
    checks.settle_all()
    assert checks.events == ["abort"]


def test_a_poll_gives_no_other_verdict_before_its_launch():
    # Read early, a plain failure is still raised at the LAG-th launch after its collective, as
    # on every rank (a poll's timing differs from rank to rank).
    checks = _C_testing._FakeDeferredChecks()
    checks.before_launch()
    checks.add([5.0], ready=True)
    checks.poll()
    for _ in range(LAG - 1):
        checks.before_launch()
        checks.poll()
    assert checks.events == [] and checks.counts["pending"] == 1
    with pytest.raises(RuntimeError, match="^fake check 0 failed$"):
        checks.before_launch()
    assert checks.counts["settled"] == 1 and checks.counts["waits"] == 0


@pytest.fixture
def fake_cuda_group(world_of_one):
    name = "test_deferred_checks"
    _C.register_group(name, dist.group.WORLD.group_name, [0])
    with _C_testing._FakeCudaCommunicators():
        yield name
    _C.unregister_group(name)


def test_a_deferred_check_comes_at_the_groups_lagth_launch(fake_cuda_group):
    _C_testing._launch(fake_cuda_group, "cuda:0")
    _C_testing._raise_if(fake_cuda_group, "cuda:0", [0.0, 2.0])
    for _ in range(LAG - 1):
        _C_testing._launch(fake_cuda_group, "cuda:0")
    assert _C._deferred_check_counts(fake_cuda_group)["pending"] == 1
    with pytest.raises(RuntimeError, match="test check failed: a value is 2"):
        _C_testing._launch(fake_cuda_group, "cuda:0")


def test_check_deferred_gives_the_pending_checks_now(fake_cuda_group):
    _C_testing._launch(fake_cuda_group, "cuda:1")
    _C_testing._raise_if(fake_cuda_group, "cuda:1", [3.0])
    ts.distributed.check_deferred("tp")  # another group: nothing pending there
    with pytest.raises(RuntimeError, match="test check failed: a value is 3"):
        ts.distributed.check_deferred(fake_cuda_group)
    ts.distributed.check_deferred()  # given once
    _C_testing._raise_if(fake_cuda_group, "cuda:1", [4.0])
    with pytest.raises(RuntimeError, match="test check failed: a value is 4"):
        ts.distributed.check_deferred()  # every group
    assert _C._deferred_check_counts(fake_cuda_group)["pending"] == 0


def test_check_deferred_names_a_bad_group(world_of_one):
    with pytest.raises(RuntimeError, match="unknown group 'nope'"):
        ts.distributed.check_deferred("nope")
    with pytest.raises(ValueError, match="check_deferred: group must be a group's name"):
        ts.distributed.check_deferred("")


def test_destroy_process_group_raises_what_no_collective_came_to_give(tmp_path):
    # Its own process: the session's world of one must stay.
    script = textwrap.dedent(f"""
        import torch.distributed as dist
        import shardtorch as ts
        from shardtorch import _C, _C_testing
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / 'store')!r}, 1), rank=0, world_size=1)
        ts.distributed.init_process_group(group_size=1)
        fake = _C_testing._FakeCudaCommunicators()
        _C_testing._launch("tp", "cuda:0")
        _C_testing._raise_if("tp", "cuda:0", [0.0, 9.0])  # the last step's loss: no collective follows
        try:
            ts.distributed.destroy_process_group()
        except RuntimeError as error:
            print("raised:", str(error).splitlines()[0])
        print("groups left:", _C.group_names(), "initialised:", ts.distributed.is_initialized())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert "raised: test check failed: a value is 9" in done.stdout, done.stdout
    assert "groups left: [] initialised: False" in done.stdout, done.stdout
