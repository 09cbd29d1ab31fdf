#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite while it builds against
# the CPU-only torch 2.13.0, then runs a smoke subset there so that build cannot rot.
# Extra arguments go to pytest (e.g. scripts/test.sh -k linear).
#   SHARDTORCH_SKIP_CPU_ONLY=1  skip the CPU-only torch build
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
SHARDTORCH_EXTRAS="${SHARDTORCH_EXTRAS-test,hf}" bash scripts/setup.sh
export PATH="$REPO/.venv/bin:$PATH"

status=0
# The CPU-only build runs beside the suite: the suite leaves the second core idle half the time (process
# start-up, waits in collectives), and that build writes only its own venv and build tree (non-editable).
cpu_only_log=$(mktemp)
if [ "${SHARDTORCH_SKIP_CPU_ONLY:-0}" != 1 ]; then
  SHARDTORCH_VENV=.venv-cpu SHARDTORCH_TORCH=torch==2.13.0 SHARDTORCH_EDITABLE=0 SHARDTORCH_EXTRAS=test SHARDTORCH_CUDA=0 \
    SHARDTORCH_JOBS=1 bash scripts/setup.sh >"$cpu_only_log" 2>&1 &
  cpu_only_setup=$!
fi
.venv/bin/python -m pytest tests "$@" || status=$?

if [ "${SHARDTORCH_SKIP_CPU_ONLY:-0}" != 1 ]; then
  echo "== CPU-only torch 2.13.0: build and smoke tests"
  wait "$cpu_only_setup" || { cat "$cpu_only_log"; exit 1; }
  cat "$cpu_only_log"
  # Run from a copy of the tests so that the installed package, not the source
  # tree (built against the other torch), is imported; csrc/ beside it for the
  # tests that read the C++ sources (no Python package there).
  smoke_dir=$(mktemp -d)
  cp -r tests "$smoke_dir/tests"
  cp -r csrc "$smoke_dir/csrc"
  # What proves that build works: every op against its reference (the ops tier, less the peak-memory sweeps,
  # which measure the allocator, not the build) and one 2-rank launch of ParallelLinear's cases (Gloo,
  # the communicator). The unit tier and the other launches ran above on the same sources.
  (cd "$smoke_dir" && "$REPO/.venv-cpu/bin/python" -m pytest -q -p no:cacheprovider \
     tests/ops tests/distributed/test_parallel_linear.py::test_parallel_linear \
     -k "not compile and not peak_memory and not 4]" ) || status=$?
  rm -rf "$smoke_dir"
fi
exit $status
