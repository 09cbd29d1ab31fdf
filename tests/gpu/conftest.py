"""GPU tests: skipped cleanly without CUDA. One process, a world of one rank
(Gloo for bootstrap; shard ops on CUDA tensors use NCCL and cuBLASLt directly)."""
import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="session")
def cuda_world_of_one(world_of_one):
    import shardtorch as ts
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not ts.cuda_built:
        pytest.fail("a CUDA device is present but shardtorch was built without its CUDA part")
    yield
