#!/usr/bin/env bash
# Builds shardtorch on a GPU machine and runs the GPU tests and benchmarks in a
# few minutes. Made for the device tool's H200 machine (torch 2.11 + CUDA 13,
# nvcc, cmake, ninja, pybind11, pytest, no network): it builds in place with
# the machine's own torch (an extension built elsewhere will not load there).
#
#   bash tests/gpu/run.sh [quick]  build, GPU tests, benchmarks/gpu_probe.py: one short call
#                                  (each stage under a time limit, about 8 minutes at most)
#   bash tests/gpu/run.sh full     the same build and tests, then the longer benchmarks
#                                  (longer than one 10-minute call of the device tool)
#
#   OUT          folder for logs (the device tool sets it; default build/gpu-out)
#   SHARDTORCH_CUDA_ARCH  default 9.0 (Hopper)
set -uo pipefail
MODE="${1:-quick}"
case "$MODE" in quick|full) ;; *) echo "usage: bash tests/gpu/run.sh [quick|full]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/../.."
OUT="${OUT:-build/gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 SHARDTORCH_CUDA=1 SHARDTORCH_CUDA_ARCH="${SHARDTORCH_CUDA_ARCH:-9.0}"
export SHARDTORCH_JOBS="${SHARDTORCH_JOBS:-$(nproc)}" SHARDTORCH_BUILD_DIR=build/gpu
# The GPU tests drive some of the C++ core's test doubles (shardtorch._C_testing) too.
export SHARDTORCH_BUILD_TEST_DOUBLES=1
# The CMake first: the CUDA part needs 3.25.2 or newer (docs/building.md).
{ cmake --version 2>&1 || echo "cmake: not found"; } | head -1 | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

# Stage limits (seconds) of the quick mode: 4 + 2.5 + 1.5 minutes. Only the library and its
# Python module are built (SHARDTORCH_BUILD_TESTS stays 0), for one architecture, with every core.
limit() { if [ "$MODE" = quick ]; then echo "timeout -k 10 $1"; fi; }
summary=()
stage() {  # stage NAME LOG COMMAND...: runs it, logs it, records its status and time
  local name=$1 log=$2 t0 rc; shift 2
  t0=$(date +%s)
  "$@" >"$log" 2>&1; rc=$?
  tail -25 "$log"
  summary+=("$(printf '%-10s rc %-3s %4s s  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$log")")
  return $rc
}

status=0
stage build "$OUT/build.log" $(limit 240) $PY setup.py build_ext --inplace || status=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ $status = 0 ]; then
  stage gpu-tests "$OUT/gpu-tests.log" $(limit 150) $PY -m pytest tests/gpu -v -rs -p no:cacheprovider -o faulthandler_timeout=60 || status=1
  stage probe "$OUT/probe.log" $(limit 90) $PY benchmarks/gpu_probe.py --out "$OUT" || status=1
fi
echo "== summary ($MODE)"; printf '%s\n' "${summary[@]}"
grep -E "passed|failed|error" "$OUT/gpu-tests.log" 2>/dev/null | tail -1
sed -n '/^== probe/,$p' "$OUT/probe.log" 2>/dev/null
[ "$MODE" = quick ] && exit $status
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
