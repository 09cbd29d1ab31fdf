"""What a first multi-GPU node meets that a plain CUDA test would not: GEMMs
on offset views and with a dimension of 1 (cuBLASLt's alignment and its
heuristic's gaps), the fused loss under autocast (GEMMs in the autocast dtype,
statistics in float32), tensors on a device other than the current one, and
several backends of torch.distributed with uneven NCCL gathers (two GPUs).
Skipped without a GPU; the two-GPU tests without two."""
import json
import os

import pytest
import torch

import shardtorch as ts
from tests.distributed.harness import REPO, run_script
from tests.doubles import _C_testing
from tests.reference import cross_entropy_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not ts.cuda_built,
                                 reason="needs a CUDA device and shardtorch built with CUDA")]
OPS = torch.ops.shard
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def _needs_the_cuda_world(cuda_world_of_one):
    yield


def _linear_against_float64(x, w, b, dtype):
    """parallel_linear forward and backward against torch's linear in float64."""
    y = OPS.parallel_linear(x, w, b, None, "tp")
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    y64 = torch.nn.functional.linear(x64, w64, b64)
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
    g = torch.randn_like(y64)
    y.backward(g.to(dtype))
    y64.backward(g)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol * 4, atol=tol * 4)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=tol * 4, atol=tol * 4)
    if b is not None:
        torch.testing.assert_close(b.grad.double(), b64.grad, rtol=tol * 4, atol=tol * 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gemm_on_offset_views(dtype):
    """x[1:] with an odd K in half precision is only 2-byte aligned, and so are
    the weight and bias slices: cuBLASLt must be told, or fall back."""
    torch.manual_seed(0)
    K = 33
    big_x = torch.randn(9, K, device="cuda", dtype=dtype, requires_grad=True)
    big_w = torch.randn(18, K, device="cuda", dtype=dtype, requires_grad=True)
    big_b = torch.randn(18, device="cuda", dtype=dtype, requires_grad=True)
    x, w, b = big_x.narrow(0, 1, 8), big_w.narrow(0, 1, 17), big_b.narrow(0, 1, 17)
    assert x.data_ptr() % 16 and w.data_ptr() % 16 and b.data_ptr() % 16
    y = OPS.parallel_linear(x, w, b, None, "tp")
    ref = torch.nn.functional.linear(x.detach().double(), w.detach().double(), b.detach().double())
    torch.testing.assert_close(y.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])
    y.sum().backward()
    torch.testing.assert_close(big_b.grad[1:18].double(), torch.full((17,), 8.0, device="cuda",
                                                                     dtype=torch.float64))
    ones = torch.ones(8, 17, device="cuda", dtype=torch.float64)
    torch.testing.assert_close(big_x.grad[1:].double(), ones @ w.detach().double(),
                               rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4)
    torch.testing.assert_close(big_w.grad[1:].double(), ones.t() @ x.detach().double(),
                               rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gemm_plans_reused_across_data_bias_and_alignment(dtype):
    """cuBLASLt's descriptors and algorithm are made once per kind of GEMM and reused: the same
    shape again with new data, a new bias (its pointer is the call's, not the first one's), an
    offset view (another alignment: another plan) and back, each against float64."""
    torch.manual_seed(2)
    K = 33
    for step, offset in enumerate([0, 0, 1, 0, 1]):
        big_x = torch.randn(9, K, device="cuda", dtype=dtype)
        big_w = torch.randn(18, K, device="cuda", dtype=dtype)
        big_b = torch.randn(18, device="cuda", dtype=dtype) * (step + 1)
        x, w, b = big_x.narrow(0, offset, 8), big_w.narrow(0, offset, 17), big_b.narrow(0, offset, 17)
        for bias in (b, None):
            y = OPS.parallel_linear(x, w, bias, None, "tp")
            ref = torch.nn.functional.linear(x.double(), w.double(),
                                             bias.double() if bias is not None else None)
            torch.testing.assert_close(y.double(), ref, rtol=TOL[dtype], atol=TOL[dtype] * (step + 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (16, 64, 1), (16, 1, 48), (1, 1, 1)])
def test_gemm_with_a_dimension_of_one(dtype, m, k, n):
    """Batch-1 inference and one-row shards: cuBLASLt's heuristic has no
    algorithm there; like PyTorch, shardtorch takes plain cuBLAS."""
    torch.manual_seed(1)
    x = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    _linear_against_float64(x, w, b, dtype)


@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
def test_fused_loss_under_autocast(amp_dtype):
    """GEMMs in the autocast dtype, statistics and loss in float32: the loss
    and gradients match the float64 loss of the autocast-rounded operands."""
    torch.manual_seed(3)
    head = torch.nn.Linear(64, 3001).cuda()
    x = torch.randn(40, 64, device="cuda", requires_grad=True)
    target = torch.randint(0, 3001, (40,), device="cuda")
    with torch.autocast("cuda", dtype=amp_dtype):
        loss = ts.nn.functional.parallel_linear_cross_entropy(x, head.weight, head.bias, target,
                                                              chunk_size=1000, label_smoothing=0.1)
    assert loss.dtype == torch.float32
    loss.backward()
    assert head.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    # The reference: float64 from the operands rounded as autocast rounds them.
    x64 = x.detach().to(amp_dtype).double().requires_grad_()
    w64 = head.weight.detach().to(amp_dtype).double().requires_grad_()
    b64 = head.bias.detach().to(amp_dtype).double().requires_grad_()
    ref = cross_entropy_reference(torch.nn.functional.linear(x64, w64, b64), target, None, -100,
                                  "mean", 0.1, 0.0)
    ref.backward()
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[amp_dtype]
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol * 5, atol=tol)
    torch.testing.assert_close(head.weight.grad.double(), w64.grad, rtol=tol * 5, atol=tol)
    torch.testing.assert_close(head.bias.grad.double(), b64.grad, rtol=tol * 5, atol=tol)


@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [37, 256])
def test_logits_written_in_place_into_a_wider_block(amp_dtype, chunk_size):
    """Under autocast a block of rows holding more columns than chunk_size gets its logits GEMM by
    GEMM straight into its column ranges (cuBLASLt's C leading dimension is the block's width): an
    odd chunk size puts every range at an unaligned offset; the result is the float64 loss of
    the autocast-rounded operands."""
    torch.manual_seed(4)
    rows, classes, features = 96, 1001, 40
    x = torch.randn(rows, features, device="cuda", requires_grad=True)
    w = (torch.randn(classes, features, device="cuda") / features ** 0.5).requires_grad_()
    target = torch.randint(0, classes, (rows,), device="cuda")
    with torch.autocast("cuda", dtype=amp_dtype):
        loss = ts.nn.functional.parallel_linear_cross_entropy(x, w, None, target, chunk_size=chunk_size)
    loss.backward()
    x64 = x.detach().to(amp_dtype).double().requires_grad_()
    w64 = w.detach().to(amp_dtype).double().requires_grad_()
    ref = cross_entropy_reference(torch.nn.functional.linear(x64, w64), target, None, -100, "mean", 0.0, 0.0)
    ref.backward()
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[amp_dtype]
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol * 5, atol=tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=tol * 5, atol=tol)


@pytest.mark.parametrize("rows,classes", [(4, 300_007), (64, 200_007)])
def test_rows_split_over_blocks_match_reference(rows, classes):
    """Few rows over many classes: each row is split over many blocks (and
    merged); an odd class count takes the one-value loads, a multiple of 8 the
    16-byte loads (rows 16-byte aligned)."""
    torch.manual_seed(4)
    for cols in (classes, classes + 1):
        full = (torch.randn(rows, cols, dtype=torch.float64) * 4).cuda()
        target = torch.randint(0, cols, (rows,), device="cuda")
        for dtype in (torch.float32, torch.bfloat16):
            x = full.to(dtype).requires_grad_()
            loss = OPS.parallel_cross_entropy(x, target, None, -100, 0.1, 0.0, 1, "tp", cols)
            loss.backward()
            x64 = full.to(dtype).double().requires_grad_()
            ref = cross_entropy_reference(x64, target, None, -100, "mean", 0.1, 0.0)
            ref.backward()
            tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
            torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
            torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol / cols)


@two_gpus
def test_tensors_on_a_device_other_than_the_current_one():
    """With cuda:0 current, every op on cuda:1 tensors runs on cuda:1 (its
    stream, its communicator) and gives what it gives on cuda:0."""
    torch.manual_seed(5)
    torch.cuda.set_device(0)
    x0 = torch.randn(12, 32, device="cuda:0")
    w0 = torch.randn(301, 32, device="cuda:0")
    target0 = torch.randint(0, 301, (12,), device="cuda:0")
    results = {}
    for device in ("cuda:0", "cuda:1"):
        x = x0.to(device).requires_grad_()
        w = w0.to(device).requires_grad_()
        target = target0.to(device)
        logits = OPS.parallel_linear(x, w, None, 1, "tp")
        loss = OPS.parallel_cross_entropy(logits, target, None, -100, 0.0, 0.0, 1, "tp", 301)
        fused = OPS.parallel_linear_cross_entropy(x, w, None, target, None, -100, 0.0, 0.0, 1, 100,
                                                  "tp", 301)
        (loss + fused).backward()
        reduced = OPS.reduce(logits.detach(), "tp")
        assert torch.cuda.current_device() == 0
        assert loss.device == fused.device == reduced.device == torch.device(device)
        results[device] = [t.cpu() for t in (loss, fused, x.grad, w.grad, reduced)]
    torch.cuda.synchronize(1)
    for a, b in zip(results["cuda:0"], results["cuda:1"]):
        torch.testing.assert_close(a, b)
    assert _C_testing._communicator_backend("tp", "cuda:1") == "nccl"


@two_gpus
@pytest.mark.parametrize("backend", ["nccl", "gloo", "cpu:gloo,cuda:nccl"])
def test_two_gpus_under_any_backend_with_uneven_gathers(backend):
    """Two ranks that never call set_device, under each backend
    torch.distributed may be started with: shard ops on each rank's GPU
    (NCCL through the store-shared id), an uneven gather, CPU tensors too."""
    script = os.path.join(REPO, "tests", "distributed", "scripts", "cuda_backends.py")
    results = run_script(script, 2, [backend], timeout=300)
    for rank, (code, output) in enumerate(results):
        assert code == 0, output[-3000:]
        lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        assert lines and lines[-1]["ok"], output[-3000:]
        assert lines[-1]["device"] == f"cuda:{rank}"
