"""The CUDA path's device-free rules, driven on CPU (no GPU needed; the NCCL
wiring itself runs in tests/gpu): which device a communicator is made for and
that it is made once, the per-device launch lock under threads, the NCCL id's
trip through the group's store, the teardown choice, and groups whose
process group cannot move CPU tensors (torch.distributed started with
backend="nccl")."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

import shardtorch as ts
from shardtorch import _C
from tests.doubles import _C_testing
from shardtorch.distributed.state import groups_backend

HOLD = 0.3


def _in_threads(fn, args):
    """fn(arg) for every arg, each on its own thread, all at once; the results in order."""
    results = [None] * len(args)

    def run(i):
        results[i] = fn(args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _hold_in_threads(devices):
    return _in_threads(lambda device: _C_testing._hold_launch_lock(device, HOLD), devices)


def _overlap(a, b):
    return min(a[1], b[1]) - max(a[0], b[0])


def test_nccl_launches_go_through_the_device_launch_lock():
    # The tests above drive comm::with_device_launch_lock on CPU; this one ties
    # it to the launches themselves, which only run on a GPU (tests/gpu).
    import pathlib
    source = (pathlib.Path(__file__).parents[2] / "csrc" / "comm" / "nccl_communicator.cpp").read_text()
    enqueue = source[source.index("std::shared_ptr<CommHandle> enqueue("):]
    enqueue = enqueue[:enqueue.index("\n  }\n")]
    assert "return with_device_launch_lock(launch_mutex_, [&] {" in enqueue
    assert enqueue.index("with_device_launch_lock") < enqueue.index("launch(stream_.stream())")
    assert "launch_mutex_(device_launch_mutex(c10::Device(c10::kCUDA, device_)))" in source


def test_launch_lock_serialises_one_device():
    spans = _hold_in_threads(["cuda:0", "cuda:0", "cuda:0"])
    spans.sort()
    for first, second in zip(spans, spans[1:]):
        assert second[0] >= first[1] - 1e-4, spans  # one after the other
    assert spans[-1][1] - spans[0][0] >= 3 * HOLD - 1e-3


def test_launch_lock_leaves_other_devices_free():
    a, b = _hold_in_threads(["cuda:0", "cuda:1"])
    assert _overlap(a, b) > HOLD / 2, (a, b)  # cuda:1 did not wait for cuda:0


def test_launch_lock_clock_is_pythons_monotonic():
    before = time.monotonic()
    start, end = _C_testing._hold_launch_lock("cuda:3", 0.01)
    after = time.monotonic()
    assert before <= start <= end <= after


def test_store_exchange_gives_every_rank_the_roots_bytes():
    payload = b"\x00unique id\xff" * 10  # NUL and non-UTF-8 bytes must survive
    for root in (0, 2):
        received = _C_testing._share_through_store_threads(4, payload, root)
        assert received == [payload] * 4


def test_exchange_keys_are_fresh_per_scope():
    # Every rank counts its own creations: the n-th exchange of a scope gets
    # the same key on every rank, and never a key used before.
    first = _C_testing._next_exchange_key("test/keys/tp")
    second = _C_testing._next_exchange_key("test/keys/tp")
    other = _C_testing._next_exchange_key("test/keys/dp")
    assert first == "test/keys/tp/0" and second == "test/keys/tp/1"
    assert other == "test/keys/dp/0"


def test_nccl_unique_id_key_is_the_groups_not_the_devices():
    # The ranks of one group sit on different GPUs: a key naming the rank's
    # device made rank 1 (cuda:1) wait for a key rank 0 (cuda:0) never wrote.
    assert _C_testing._nccl_unique_id_scope("tp") == "shardtorch/nccl_unique_id/tp"


def test_ranks_on_cuda0_and_cuda1_get_rank0s_nccl_id_within_a_second():
    # Two threads, each a rank with its own process counter (on cuda:0 and
    # cuda:1), build NcclCommunicator's key and exchange over one HashStore
    # whose waits time out after 1 s: a rank that waited on another key fails.
    payload = bytes(range(128))  # an ncclUniqueId is 128 bytes
    received, errors, seconds = _C_testing._share_nccl_unique_id_threads("tp", payload, world=2, timeout=1.0)
    assert errors == [] and received == [payload, payload], errors
    assert seconds < 1.0, seconds


def test_teardown_depends_only_on_whether_the_communicator_failed():
    # Healthy ranks never choose from work counts (which lag the GPU
    # differently on each rank): they all drain, then destroy.
    assert _C_testing._nccl_teardown(False) == "drain_then_destroy"
    assert _C_testing._nccl_teardown(True) == "release"


@pytest.fixture
def fake_group(world_of_one):
    name = "test_fake_devices"
    _C.register_group(name, dist.group.WORLD.group_name, [0])
    yield name
    _C.unregister_group(name)


def test_communicators_are_per_full_device_and_made_once(fake_group):
    calls = ["cuda:1"] * 6 + ["cuda:0"] * 6
    with _C_testing._FakeCudaCommunicators(delay=0.3) as fake:
        got = _in_threads(lambda device: _C_testing._communicator_backend(fake_group, device), calls)
        created = sorted(fake.created)
        # Later calls reuse them.
        assert _C_testing._communicator_backend(fake_group, "cuda:1") == got[0]
    assert created == [f"{fake_group}@cuda:0", f"{fake_group}@cuda:1"], created
    assert len(set(got[:6])) == 1 and len(set(got[6:])) == 1, got
    assert got[0] != got[6]
    assert "@cuda:1 #" in got[0] and "@cuda:0 #" in got[6]


def test_a_device_without_index_is_refused(fake_group):
    with _C_testing._FakeCudaCommunicators():
        with pytest.raises(RuntimeError, match="full device"):
            _C_testing._communicator_backend(fake_group, "cuda")


@pytest.mark.parametrize("config,expected", [
    ("cuda:nccl", "cpu:gloo,cuda:nccl"),                 # backend="nccl"
    ("cpu:gloo,cuda:gloo", None),                        # backend="gloo"
    ("cpu:gloo,cuda:nccl", None),                        # both
    ("cpu:mpi,cuda:mpi", None),
    ("cuda:nccl,xpu:xccl", "cpu:gloo,cuda:nccl,xpu:xccl"),
])
def test_groups_get_a_cpu_backend_when_the_default_has_none(config, expected):
    assert groups_backend(config) == expected


def test_new_groups_follow_the_default_backend(monkeypatch):
    from shardtorch.distributed import state
    monkeypatch.setattr(state.dist, "get_backend_config", lambda group=None: "cuda:nccl")
    assert state._new_group_kwargs(state.default_timeout()) == {
        "timeout": state.default_timeout(), "backend": "cpu:gloo,cuda:nccl"}
    monkeypatch.setattr(state.dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    assert state._new_group_kwargs(state.default_timeout()) == {"timeout": state.default_timeout()}


@pytest.fixture
def group_without_cpu_backend(world_of_one):
    name = "test_nccl_only"
    _C_testing._register_group_without_cpu_backend(name)
    yield name
    _C.unregister_group(name)


def test_cpu_tensors_on_a_group_without_cpu_backend_get_a_clear_error(group_without_cpu_backend):
    with pytest.raises(RuntimeError, match="has no backend for CPU tensors"):
        torch.ops.shard.reduce(torch.ones(3), group_without_cpu_backend)


def test_nccl_id_travels_through_the_store_of_any_group(group_without_cpu_backend):
    payload = b"\x01\x00" * 64  # an ncclUniqueId is 128 bytes
    assert _C_testing._share_through_group_store(group_without_cpu_backend, payload) == payload
    # A Gloo group's store works the same way.
    assert _C_testing._share_through_group_store("tp", payload) == payload
