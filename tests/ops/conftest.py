"""Single-process op tests: a world of one rank (Gloo, in-process) so that the
ops find their group."""
import os
import tempfile

import pytest
import torch.distributed as dist

import shardtorch as ts


@pytest.fixture(scope="session", autouse=True)
def world_of_one():
    store_file = tempfile.NamedTemporaryFile(delete=False)
    store_file.close()
    store = dist.FileStore(store_file.name, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    ts.distributed.init_process_group(group_size=1)
    yield
    ts.distributed.destroy_process_group()
    dist.destroy_process_group()
    os.unlink(store_file.name)
