"""shard::_row_sparse_adam_ on CUDA (the rows gathered, updated with a step per row by device
arithmetic and written back) against the float64 formula, as tests/ops/test_row_sparse_adam_op.py
checks the CPU kernel; skipped where no GPU is present."""
import pytest
import torch

import shardtorch as ts
from tests.ops.test_row_sparse_adam_op import SETTINGS, device_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not ts.cuda_built,
                                 reason="needs a CUDA device and shardtorch built with CUDA")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_rows_given_follow_adam_at_their_own_steps_and_nothing_else_moves_on_cuda(name, dtype):
    device_case("cuda", dtype, name, 512)
