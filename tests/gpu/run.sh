#!/usr/bin/env bash
# Builds shardtorch on a GPU machine and runs the GPU tests and benchmarks. Made for the device
# tool's H200 machine (torch 2.11 + CUDA 13, nvcc, cmake, ninja, pybind11, pytest, no network): it
# builds in place with the machine's own torch (an extension built elsewhere will not load there).
#
#   bash tests/gpu/run.sh [quick]  build, GPU tests, the compile and profiler tests, benchmarks/gpu_probe.py:
#                                  one call of the device tool, 9 minutes at most in all
#   bash tests/gpu/run.sh full     the same stages without time limits, then the longer benchmarks
#                                  (longer than one 10-minute call of the device tool)
#
#   OUT          folder for logs (the device tool sets it; default build/gpu-out)
#   SHARDTORCH_CUDA_ARCH  default 9.0 (Hopper)
#   SHARDTORCH_GPU_BUDGET seconds for the quick mode's stages together (default 540)
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

# Quick mode: the stages share one budget. Each stage is planned a share (seconds, the order they
# run in); a stage may use what earlier stages left unused, but never the shares of the stages
# after it, so a slow build cannot eat the tests' time and the whole run ends within the budget
# (plus 10 s of grace per stage for a killed stage to end).
STAGES=(build gpu-tests tooling probe)
declare -A PLAN=([build]=180 [gpu-tests]=180 [tooling]=90 [probe]=90)
BUDGET="${SHARDTORCH_GPU_BUDGET:-540}"
START=$(date +%s)
limit_for() {  # limit_for NAME: seconds the stage may run (quick mode)
  local name=$1 later=0 after=0 s
  for s in "${STAGES[@]}"; do
    if [ $after = 1 ]; then later=$(( later + PLAN[$s] )); fi
    if [ "$s" = "$name" ]; then after=1; fi
  done
  echo $(( BUDGET - ($(date +%s) - START) - later ))
}

summary=()
stage() {  # stage NAME LOG COMMAND...: runs it under its limit, logs it, records its status and time
  local name=$1 log=$2 t0 rc lim=none; shift 2
  t0=$(date +%s)
  if [ "$MODE" = quick ]; then
    lim=$(limit_for "$name")
    if [ "$lim" -lt 10 ]; then
      summary+=("$(printf '%-10s %-16s %4s s  limit %-5s %s' "$name" "NOT RUN (no time)" 0 "$lim" "$log")")
      echo "no time left for $name" >"$log"
      return 1
    fi
    timeout -k 10 "$lim" "$@" >"$log" 2>&1; rc=$?
  else
    "$@" >"$log" 2>&1; rc=$?
  fi
  tail -15 "$log"
  local what="rc $rc"
  if [ $rc = 124 ] || [ $rc = 137 ]; then what="TIMED OUT"; fi
  summary+=("$(printf '%-10s %-16s %4s s  limit %-5s %s' "$name" "$what" "$(( $(date +%s) - t0 ))" "$lim" "$log")")
  return $rc
}

PYTEST=($PY -m pytest -v -rfE -p no:cacheprovider -o faulthandler_timeout=60)
status=0
stage build "$OUT/build.log" $PY setup.py build_ext --inplace || status=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ $status = 0 ]; then
  # The compile and profiler tests (marker `tooling`) start torch.compile or the profiler: slow
  # to start, so they run apart and cannot take the other tests' time.
  stage gpu-tests "$OUT/gpu-tests.log" "${PYTEST[@]}" tests/gpu -m "not tooling" || status=1
  stage tooling "$OUT/tooling.log" "${PYTEST[@]}" tests/gpu -m tooling || status=1
  stage probe "$OUT/probe.log" $PY benchmarks/gpu_probe.py --out "$OUT" || status=1
fi

pytest_summary() {  # pytest_summary LOG: its result line, what failed (10 at most), a test cut off
  local log=$1
  [ -f "$log" ] && ! grep -q "^no time left" "$log" || return 0
  grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)" "$log" | tail -1 | sed 's/^/    /'
  grep -E "^(FAILED|ERROR) " "$log" | head -10 | cut -c1-150 | sed 's/^/    /'
  if ! grep -qE "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)" "$log"; then
    echo "    cut off during: $(grep -E '^tests/gpu/.*::' "$log" | tail -1 | cut -c1-120)"
  fi
}
echo
echo "== summary ($MODE, $(( $(date +%s) - START )) s)"
head -3 "$OUT/gpu.txt" | sed 's/^/  /'
printf '  %s\n' "${summary[@]}"
for s in gpu-tests tooling; do
  if [ -f "$OUT/$s.log" ]; then echo "  $s:"; pytest_summary "$OUT/$s.log"; fi
done
sed -n '/^== probe/,$p' "$OUT/probe.log" 2>/dev/null | head -20
echo "== $( [ $status = 0 ] && echo OK || echo FAILED )"
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
