#!/usr/bin/env bash
# Installs the libraries benchmarks/peers.py compares shardtorch with (TorchShard,
# FairScale, Megatron-core) into benchmarks/.peers, a folder of its own that the
# benchmark puts on sys.path: the virtual environment stays exactly what
# scripts/setup.sh made (no peer package, and none of their dependencies, there;
# --no-deps keeps pip from replacing torch).
#
#   PYTHON   interpreter whose pip to use (default .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
TARGET=benchmarks/.peers
# Pinned so that the figures in benchmarks/results/comparison.md can be reproduced. None of
# them needs more than torch, numpy and packaging (all in the venv) for the layers
# used here; SHARDTORCH_PEERS_EXTRA adds pure-python packages to the same folder.
PEERS="${SHARDTORCH_PEERS:-torchshard==0.1.0 fairscale==0.4.13 megatron-core==0.16.1}"
EXTRA="${SHARDTORCH_PEERS_EXTRA:-}"
mkdir -p "$TARGET"
"$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$TARGET" $PEERS $EXTRA
# fairscale's sdist also installs its own top-level "benchmarks" package and a
# bin/ folder; neither is imported by fairscale, and the former would shadow
# this repository's benchmarks/ for anyone who puts $TARGET first on sys.path.
rm -rf "$TARGET/benchmarks" "$TARGET/bin"
echo "setup_peers: installed into $TARGET:"
ls "$TARGET"
