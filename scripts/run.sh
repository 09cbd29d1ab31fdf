#!/usr/bin/env bash
# Sets up this checkout (scripts/setup.sh) and runs the main job: a classifier
# over 100,000 classes trained on 2 CPU processes with its head sharded, ending
# with each rank's measured memory against the unsharded equivalent.
# Extra arguments go to the training program (see --help), e.g.
#   bash scripts/run.sh --steps 200 --fused-loss
#   SHARDTORCH_NPROC=4 bash scripts/run.sh --layout 2d --group-size 2
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchrun --nproc-per-node "${SHARDTORCH_NPROC:-2}" examples/python/train_classifier.py "$@"
