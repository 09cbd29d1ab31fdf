#!/usr/bin/env bash
# Sets up this checkout on a fresh machine (Python 3.11, pip; apt-get when root):
# system packages, a virtual environment with torch, and shardtorch built in place.
#
#   SHARDTORCH_VENV    virtual environment to create or reuse (default .venv)
#   SHARDTORCH_TORCH   torch requirement (default torch==2.14.1, the CUDA 13.0 build;
#                      torch==2.13.0 is CPU-only)
#   SHARDTORCH_EDITABLE  1 (default): editable install in place; 0: a regular install
#   SHARDTORCH_EXTRAS  extras of setup.py to install with it (default "test"; scripts/test.sh: "test,hf")
# plus the build variables documented in setup.py (SHARDTORCH_CUDA, SHARDTORCH_CUDA_ARCH, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SHARDTORCH_VENV:-.venv}"
TORCH_SPEC="${SHARDTORCH_TORCH:-torch==2.14.1}"
EXTRAS="${SHARDTORCH_EXTRAS-test}"

# ccache speeds up rebuilds; Gloo's headers let C++ programs create Gloo groups
# without Python. Both are optional: the build works without them.
APT_PACKAGES="ccache libgloo-dev"
missing=""
for pkg in $APT_PACKAGES; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "setup: installing$missing"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null \
    || echo "setup: apt-get failed; continuing without$missing"
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# torch (with numpy, which it imports if present) and what the build needs (pip's cmake: Debian's
# 3.25.1 cannot build the CUDA part).
$PIP install -q --disable-pip-version-check "$TORCH_SPEC" numpy pybind11 ninja cmake setuptools wheel 2>&1 \
  | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import torch" # fail here, clearly, if torch did not install

export PATH="$PWD/$VENV/bin:$PATH"
# ccache keys on paths relative to the checkout, so that another clone of the
# repository (CI's) reuses what this one compiled.
export CCACHE_BASEDIR="$PWD"
start=$(date +%s)
# The extras (setup.py's EXTRAS) come with the package: "test" for the suite,
# "hf" for the Hugging Face / timm models of ts.nn.parallelize and train_lm.py.
target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
if [ "${SHARDTORCH_EDITABLE:-1}" = 1 ]; then
  $PIP install -q --disable-pip-version-check --no-build-isolation -e "$target" 2>&1 | grep -v "^WARNING: Location" || true
else
  $PIP install -q --disable-pip-version-check --no-build-isolation "$target" 2>&1 | grep -v "^WARNING: Location" || true
fi
(cd /tmp && "$OLDPWD/$VENV/bin/python" -c "import shardtorch, torch; print('setup: shardtorch', shardtorch.__version__, 'cuda part:', shardtorch.cuda_built, 'torch', torch.__version__)")
echo "setup: build and install took $(( $(date +%s) - start )) s"
