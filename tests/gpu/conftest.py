"""GPU tests: skipped cleanly without CUDA. One process, a world of one rank
(Gloo for bootstrap; shard ops on CUDA tensors use NCCL and cuBLASLt directly)."""
import os
import tempfile

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def cuda_world_of_one():
    import torch.distributed as dist

    import shardtorch as ts
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not ts.cuda_built:
        pytest.fail("a CUDA device is present but shardtorch was built without its CUDA part")
    store_file = tempfile.NamedTemporaryFile(delete=False)
    store_file.close()
    dist.init_process_group("gloo", store=dist.FileStore(store_file.name, 1), rank=0, world_size=1)
    ts.distributed.init_process_group(group_size=1)
    yield
    ts.distributed.destroy_process_group()
    dist.destroy_process_group()
    os.unlink(store_file.name)
