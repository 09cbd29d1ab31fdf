#!/usr/bin/env bash
# Developer loop: rebuild and reinstall into the package directory after the
# first `scripts/setup.sh` (which configured the build tree).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
# The build tree setup.py made for this Python and this torch.
default_dir=$("$PYTHON" -c "import sys, torch; print(f'build/py{sys.version_info[0]}{sys.version_info[1]}-torch' + torch.__version__.split('+')[0])")
BUILD_DIR="${SHARDTORCH_BUILD_DIR:-$default_dir}"
cmake --build "$BUILD_DIR" --parallel "${SHARDTORCH_JOBS:-$(nproc)}"
cmake --install "$BUILD_DIR" >/dev/null
cp "$BUILD_DIR"/_C*.so shardtorch/
