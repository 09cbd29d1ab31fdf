#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite. The other builds are checked beside it, in one
# chain on one core (the suite leaves the second core idle most of the time: process start-up, waits in
# collectives): the CUDA sources against the GPU machine's torch 2.11 headers
# (tests/unit/test_cuda_compiles_against_torch_2_11.py), then the build against the CPU-only torch 2.13.0
# and a smoke subset there, so that neither can rot.
# Extra arguments go to the suite's pytest (e.g. scripts/test.sh -k linear).
#   SHARDTORCH_SKIP_CPU_ONLY=1  skip the CPU-only torch build and its smoke tests
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
# The suite drives the C++ core's test doubles (shardtorch._C_testing), which a user's build leaves out.
export SHARDTORCH_BUILD_TEST_DOUBLES="${SHARDTORCH_BUILD_TEST_DOUBLES:-1}"
SHARDTORCH_EXTRAS="${SHARDTORCH_EXTRAS-test,hf}" bash scripts/setup.sh
export PATH="$REPO/.venv/bin:$PATH"
COMPILE_TEST=tests/unit/test_cuda_compiles_against_torch_2_11.py

other_builds() {
  local status=0
  SHARDTORCH_JOBS=1 .venv/bin/python -m pytest -q -p no:cacheprovider "$COMPILE_TEST" || status=1
  [ "${SHARDTORCH_SKIP_CPU_ONLY:-0}" = 1 ] && return $status
  echo "== CPU-only torch 2.13.0: build and smoke tests"
  # Its own venv and build tree (a non-editable install), nothing the suite reads.
  SHARDTORCH_VENV=.venv-cpu SHARDTORCH_TORCH=torch==2.13.0 SHARDTORCH_EDITABLE=0 SHARDTORCH_EXTRAS=test SHARDTORCH_CUDA=0 \
    SHARDTORCH_JOBS=1 bash scripts/setup.sh || return 1
  # Run from a copy of the tests so that the installed package, not the source
  # tree (built against the other torch), is imported; csrc/ beside it for the
  # tests that read the C++ sources (no Python package there).
  local smoke_dir
  smoke_dir=$(mktemp -d)
  cp -r tests "$smoke_dir/tests"
  cp -r csrc "$smoke_dir/csrc"
  # What proves that build works: every op against its reference (the ops tier, less the peak-memory sweeps,
  # which measure the allocator, not the build) and one 2-rank launch of ParallelLinear's cases (Gloo,
  # the communicator). The unit tier and the other launches run in the suite on the same sources.
  (cd "$smoke_dir" && "$REPO/.venv-cpu/bin/python" -m pytest -q -p no:cacheprovider \
     tests/ops tests/distributed/test_parallel_linear.py::test_parallel_linear \
     -k "not compile and not peak_memory and not 4]" ) || status=1
  rm -rf "$smoke_dir"
  return $status
}
other_log=$(mktemp)
other_builds >"$other_log" 2>&1 &
other_pid=$!

status=0
.venv/bin/python -m pytest tests --ignore="$COMPILE_TEST" "$@" || status=$?

echo "== beside the suite: the CUDA sources against torch 2.11's headers$( [ "${SHARDTORCH_SKIP_CPU_ONLY:-0}" = 1 ] || echo ", the CPU-only torch 2.13.0 build and its smoke tests")"
wait "$other_pid" || status=1
cat "$other_log"
exit $status
