"""The C++ core's test doubles live in shardtorch._C_testing, not in the _C every user imports
(tests/cpp/test_packaging.py holds that a user's build does not build them at all)."""
from shardtorch import _C
from tests.doubles import _C_testing

DOUBLES = ["_FakeDeferredChecks", "_raise_if", "_launch", "_hold_launch_lock", "_nccl_teardown", "_next_exchange_key",
           "_nccl_unique_id_scope", "_share_nccl_unique_id_threads", "_share_through_store_threads",
           "_register_group_without_cpu_backend", "_share_through_group_store", "_communicator_backend",
           "_SimulatedGroup", "_FakeCudaCommunicators", "_CollectiveWatchdog"]


def test_the_doubles_are_in_the_testing_module_and_not_in_C():
    assert [name for name in DOUBLES if hasattr(_C, name)] == []
    assert [name for name in DOUBLES if not hasattr(_C_testing, name)] == []
