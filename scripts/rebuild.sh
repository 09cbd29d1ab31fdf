#!/usr/bin/env bash
# Developer loop: rebuild and reinstall into the package directory after the
# first `scripts/setup.sh` (which configured the build tree).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${SHARDTORCH_BUILD_DIR:-$(ls -d build/py*-torch* | head -1)}"
cmake --build "$BUILD_DIR" --parallel "${SHARDTORCH_JOBS:-$(nproc)}"
cmake --install "$BUILD_DIR" >/dev/null
cp "$BUILD_DIR"/_C*.so shardtorch/
