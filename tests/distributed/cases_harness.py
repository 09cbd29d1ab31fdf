"""Cases for test_harness.py, which checks the harness itself: one passes, one
fails on rank 1 only, one kills rank 1's process, and the one after must still
run (in a new launch). Not for case_tests: the crash is deliberate."""
import os

import torch.distributed as dist


def case_a_passes():
    assert dist.get_world_size() == 2


def case_b_fails_on_rank_1():
    assert dist.get_rank() != 1, "rank 1 fails on purpose"


def case_c_kills_rank_1():
    if dist.get_rank() == 1:
        os._exit(23)
    dist.barrier()  # rank 0 waits for the peer that is gone, and fails


def case_d_runs_after_the_crash():
    assert dist.get_world_size() == 2
