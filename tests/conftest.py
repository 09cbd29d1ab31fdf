import os
import tempfile

import pytest

from tests.distributed.harness import LaunchCache, case_durations_report, expected_requests

# The fused heads run their CPU GEMMs under autocast in the autocast dtype only where the CPU
# multiplies it in hardware (AMX, AVX512-BF16/FP16), float32 elsewhere. The suite asks for the
# reduced dtype on every CPU, so that the reduced-precision path is what the autocast tests check
# whatever machine runs them (the ranks it starts inherit it); test_autocast_gemm_choice.py checks
# the automatic choice itself.
os.environ["SHARDTORCH_CPU_AUTOCAST_GEMMS"] = "reduced"

# Proofs the session's parallelize calls keep (nn/whole_model/proof_cache.py) go to a folder of its own,
# empty at its start: the suite neither reads nor fills the user's cache, and every first proof runs.
os.environ.setdefault("SHARDTORCH_CACHE_DIR", tempfile.mkdtemp(prefix="shardtorch-test-cache-"))


def pytest_addoption(parser):
    parser.addoption("--case-durations", type=int, default=None, metavar="N",
                     help="after the run, list the harness's launches (seconds, start-up) and its N slowest "
                          "multi-process cases (0: all); pytest's --durations sees only whole launches")


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("--case-durations")
    lines = case_durations_report(count) if count is not None else []
    if lines:
        terminalreporter.section("launches and slowest cases")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def launches(request):
    """Multi-process launches shared by every test of the session: one per
    launch key, serving every selected test that reads that key."""
    return LaunchCache(expected_requests(request.session.items))


@pytest.fixture(scope="session")
def world_of_one():
    """A world of one rank in this process (Gloo over a FileStore), so that
    single-process op tests find their group. Shared by the whole session:
    tests must not tear it down."""
    import torch.distributed as dist

    import shardtorch as ts
    store_path = None
    if not dist.is_initialized():
        fd, store_path = tempfile.mkstemp(prefix="shardtorch-world1-")
        os.close(fd)
        os.unlink(store_path)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    if not ts.distributed.is_initialized():
        ts.distributed.init_process_group(group_size=1)
    yield
    ts.distributed.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()
