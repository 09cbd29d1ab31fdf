"""The cross-entropy ops' deferred argument checks across ranks, on CPU, with the ranks of one group
simulated in this process (``_C_testing._SimulatedGroup``: one communicator per rank, each under a group name
of its own, driven from a thread of its own). Its collectives behave for the host as NCCL's do: a
launch never blocks, a collective completes once every rank launched it, and a check's copy arrives
when its collective completes, so that a copy behind a collective that a rank never joins never
arrives; a host sync that would wait for one fails after a few seconds, standing for the hang a GPU
would have (docs/cuda.md, "Errors without host synchronisation").

A rank whose own check fails on its host raises at once and joins no later collective; its peers
must abort at their verdict, whatever the check, and no rank may be left waiting: not in its next
collectives, not in a host sync after an op that made collectives after the one that carried the
check. Where every rank fails a check of its own, none left the others waiting."""
import threading

import pytest
import torch
import torch.distributed as dist

from shardtorch import _C
from tests.doubles import _C_testing

LAG = _C._DEFERRED_CHECK_LAG
NAMES = ["simulated_rank0", "simulated_rank1"]
HANG_SECONDS = 10.0


@pytest.fixture
def simulated(world_of_one):
    for name in NAMES:
        _C.register_group(name, dist.group.WORLD.group_name, [0])
    try:
        with _C_testing._SimulatedGroup(NAMES, hang_seconds=HANG_SECONDS) as sim:
            yield sim
    finally:
        for name in NAMES:
            _C.unregister_group(name)


def run_ranks(*programs):
    """Runs programs[r] as simulated rank r, each in a thread; returns each one's
    ("returned", value) or ("raised", message)."""
    results = [None] * len(programs)

    def run(r):
        try:
            results[r] = ("returned", programs[r]())
        except Exception as error:  # noqa: BLE001 (the test reads it)
            results[r] = ("raised", str(error).splitlines()[0])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=6 * HANG_SECONDS)
    assert not any(t.is_alive() for t in threads), results
    return results


def plain_loss(logits, target, weight=None, num_classes=10):
    def call(group):
        return torch.ops.shard.parallel_cross_entropy(logits, target, weight, -100, 0.0, 0.0, 1, group,
                                                      num_classes)
    return call


def margin_loss(weight, sampled, target):
    x = torch.randn(len(target), weight.shape[1], generator=torch.Generator().manual_seed(3))

    def call(group):
        return torch.ops.shard.parallel_linear_margin_cross_entropy(
            x, weight, target, 16.0, 1.0, 0.5, 0.0, False, -100, 0.0, 1, sampled, 4096, group, 10)
    return call


def g(seed):
    return torch.Generator().manual_seed(seed)


TARGET = torch.tensor([0, 7, 3, 9])  # 10 classes: 5 a rank
# What each rank calls, the second rank failing a check that only it can make (known on its host).
FAILURES = {
    "shard size": (plain_loss(torch.randn(4, 5, generator=g(0)), TARGET),
                   plain_loss(torch.randn(4, 6, generator=g(1)), TARGET)),
    "class weight size": (plain_loss(torch.randn(4, 5, generator=g(0)), TARGET, torch.rand(5)),
                          plain_loss(torch.randn(4, 5, generator=g(1)), TARGET, torch.rand(7))),
    "probability target size": (plain_loss(torch.randn(4, 5, generator=g(0)), torch.rand(4, 5)),
                                plain_loss(torch.randn(4, 5, generator=g(1)), torch.rand(4, 7))),
    "sampled classes": (margin_loss(torch.randn(5, 8, generator=g(0)), torch.tensor([0, 1, 3]), TARGET),
                        margin_loss(torch.randn(5, 8, generator=g(1)), torch.tensor([4, 2]), TARGET)),
}
MESSAGES = {
    "shard size": "must be rank 1's shard of num_classes=10",
    "class weight size": "weight must hold this rank's 5 classes",
    "probability target size": "a probability target's last dim must be",
    "sampled classes": "sampled_classes must be strictly increasing",
}


@pytest.mark.parametrize("failure", FAILURES)
def test_every_check_a_rank_raises_alone_makes_its_peers_abort(simulated, failure):
    healthy, failing = FAILURES[failure]

    def peer():
        healthy(NAMES[0])
        for _ in range(LAG - 1):
            simulated.launch(0)      # the next collectives: the rank that failed never joins them
        simulated.launch(0)          # the verdict, at the LAG-th collective after the check's

    results = run_ranks(peer, lambda: failing(NAMES[1]))
    assert results[1][0] == "raised" and MESSAGES[failure] in results[1][1], results
    assert results[0][0] == "raised", results
    assert "group rank 1 failed a check" in results[0][1], results
    assert f"communicator for group '{NAMES[0]}' is aborted" in results[0][1], results
    # The collectives it launched meanwhile returned: a host sync does not hang.
    assert simulated.aborted(0) and simulated.stuck(0) == 0
    simulated.synchronize(0)


def test_when_every_rank_fails_a_check_of_its_own_none_is_left_waiting(simulated):
    first = plain_loss(torch.randn(4, 6, generator=g(0)), TARGET)
    second = plain_loss(torch.randn(4, 4, generator=g(1)), TARGET)
    results = run_ranks(lambda: first(NAMES[0]), lambda: second(NAMES[1]))
    for r, (how, message) in enumerate(results):
        assert how == "raised" and f"must be rank {r}'s shard of num_classes=10" in message, results
        assert "every rank of the group failed an argument check of its own" in message, results
    # Nobody left: the group's next collective runs on both ranks.
    simulated.launch(0)
    simulated.launch(1)
    simulated.synchronize(0)
    simulated.synchronize(1)
    assert not simulated.aborted(0) and not simulated.aborted(1)


# The fused loss with its gradients in forward makes collectives after the first one (a gather per
# block of rows, the input gradient's sum): by blocks of 128 rows (two blocks), or, with blocks too
# thin for 40,000 classes per rank, the logits computed twice (a gather, then the sum).
FUSED_SHAPES = {"two blocks": 40_000, "logits computed twice": 80_000}


@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_a_host_sync_after_a_fused_op_does_not_wait_for_a_rank_that_left(simulated, shape):
    # The op returns without settling its checks (no host wait per call); the host sync after it
    # returns once the watchdog has read the verdict and aborted, and check_deferred raises it.
    classes, rows, features = FUSED_SHAPES[shape], 256, 8
    target = torch.randint(0, classes, (rows,), generator=g(4))
    x = torch.randn(rows, features, generator=g(5))

    def fused(local, group):
        weight = torch.randn(local, features, generator=g(6))
        return torch.ops.shard._parallel_linear_cross_entropy_forward_with_gradients(
            x, weight, None, target, None, -100, 0.0, 0.0, 1, 4096, group, classes, [True, True, False])

    def peer():
        fused(classes // 2, NAMES[0])
        simulated.synchronize(0)     # loss.item(): waits for every collective of the op
        _C.check_deferred(NAMES[0])  # the next step's first collective, at the latest

    results = run_ranks(peer, lambda: fused(classes // 2 + 1, NAMES[1]))
    assert results[1][0] == "raised" and MESSAGES["shard size"].replace("10", str(classes)) in results[1][1]
    assert results[0][0] == "raised" and "group rank 1 failed a check" in results[0][1], results
    assert f"communicator for group '{NAMES[0]}' is aborted" in results[0][1], results
    assert simulated.stuck(0) == 0
    simulated.synchronize(0)


def test_a_healthy_group_raises_nothing_and_settles_every_check(simulated):
    # The same fused op on both ranks, nothing wrong: the op leaves its check pending (no host
    # wait), check_deferred gives it, and it passes.
    classes, rows, features = 40_000, 256, 8
    target = torch.randint(0, classes, (rows,), generator=g(4))
    x = torch.randn(rows, features, generator=g(5))

    def fused(group):
        weight = torch.randn(classes // 2, features, generator=g(6))
        loss = torch.ops.shard._parallel_linear_cross_entropy_forward_with_gradients(
            x, weight, None, target, None, -100, 0.0, 0.0, 1, 4096, group, classes, [True, True, False])[0]
        return loss.item()

    results = run_ranks(lambda: fused(NAMES[0]), lambda: fused(NAMES[1]))
    assert [how for how, _ in results] == ["returned", "returned"], results
    for r in range(2):
        counts = simulated.counts(r)
        assert counts["pending"] == 1 and counts["settled"] == 0, counts
    run_ranks(lambda: _C.check_deferred(NAMES[0]), lambda: _C.check_deferred(NAMES[1]))
    for r in range(2):
        counts = simulated.counts(r)
        assert counts["pending"] == 0 and counts["settled"] == 1 and counts["dropped"] == 0, counts
        assert not simulated.aborted(r) and simulated.stuck(r) == 0


def test_a_backward_collective_after_a_rank_left_does_not_wait_for_the_timeout(simulated):
    # parallel_cross_entropy after a column-parallel linear layer: the healthy rank's forward
    # returns (a NaN loss) before the verdict is due, and its backward launches the input
    # gradient's all-reduce, which the rank that left never joins. The watchdog reads the check's
    # copy as soon as it is on the host and aborts: the backward, or the host sync after it
    # (loss.item()), raises the verdict; neither waits for the group's timeout.
    x = torch.randn(4, 8, generator=g(7))
    target = TARGET

    def program(local, group, sync):
        def run():
            weight = torch.randn(local, 8, generator=g(8))
            inp = x.clone().requires_grad_()
            logits = torch.ops.shard.parallel_linear(inp, weight, None, 1, group)
            loss = torch.ops.shard.parallel_cross_entropy(logits, target, None, -100, 0.0, 0.0, 1, group, 10)
            loss.backward()
            if sync:
                simulated.synchronize(0)  # loss.item()
                _C.check_deferred(group)   # the next step's first collective, at the latest
            return loss.item()
        return run

    results = run_ranks(program(5, NAMES[0], True), program(6, NAMES[1], False))
    assert results[1][0] == "raised" and MESSAGES["shard size"] in results[1][1], results
    assert results[0][0] == "raised", results
    assert "group rank 1 failed a check" in results[0][1], results
    assert f"communicator for group '{NAMES[0]}' is aborted" in results[0][1], results
    assert simulated.aborted(0) and simulated.stuck(0) == 0
    simulated.synchronize(0)
