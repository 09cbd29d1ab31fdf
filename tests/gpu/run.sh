#!/usr/bin/env bash
# Builds shardtorch on a GPU machine and runs the GPU tests and benchmarks in a
# few minutes. Made for the device tool's H200 machine (torch 2.11 + CUDA 13,
# nvcc, cmake, ninja, pybind11, pytest, no network): it builds in place with
# the machine's own torch (an extension built elsewhere will not load there).
#   OUT          folder for logs (the device tool sets it; default build/gpu-out)
#   SHARDTORCH_CUDA_ARCH  default 9.0 (Hopper)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-build/gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 SHARDTORCH_CUDA=1 SHARDTORCH_CUDA_ARCH="${SHARDTORCH_CUDA_ARCH:-9.0}"
export SHARDTORCH_JOBS="${SHARDTORCH_JOBS:-$(nproc)}" SHARDTORCH_BUILD_DIR=build/gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

start=$(date +%s)
$PY setup.py -q build_ext --inplace 2>&1 | tail -20 | tee "$OUT/build.log"
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
$PY -m pytest tests/gpu -q -x 2>&1 | tee "$OUT/gpu-tests.log" || status=1
# Benchmarks: one rank per GPU; on a single GPU the parallel path runs on one
# rank (no communication), which still compares kernels and memory.
$PY benchmarks/parallel_linear.py --device cuda --world-size 1 --batch 8192 --in-features 4096 \
  --out-features 16384 --repeats 20 2>&1 | tee "$OUT/bench-linear.log" || status=1
# 64 rows over 1M classes: the case where one block per row would idle most SMs.
# The benchmark frees each batch's set of inputs before the next (one set at
# batch 4096 over 1M classes is about 110 GiB): the whole run fits one H200.
$PY benchmarks/cross_entropy.py --device cuda --world-size 1 --classes 1000000 --batches 64,1024,4096 \
  --sweep 125000,250000,500000,1000000 --iters 10 --out "$OUT" 2>&1 | tee "$OUT/bench-cross-entropy.log" || status=1
$PY - "$OUT/cross_entropy_results_cuda.json" <<'PYEOF' 2>&1 | tee -a "$OUT/bench-cross-entropy.log" || status=1
import json, sys
import torch
peak = json.load(open(sys.argv[1])).get("device_peak_bytes", 0)
total = torch.cuda.get_device_properties(0).total_memory
print(f"cross-entropy benchmark: device peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
sys.exit(0 if 0 < peak <= total else 1)
PYEOF
exit $status
