#!/usr/bin/env bash
# The main job on its built-in default: installs what is missing, builds, and trains the tiny
# GPT on synthetic data with tensor parallelism over 2 MPI ranks. Extra arguments go to
# `merak train` (for example: --set train.steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cargo build --release -p merak-launch
mpirun --oversubscribe --bind-to none -np 2 target/release/merak train --tp 2 --out runs/default "$@"
echo "metrics: runs/default/metrics.jsonl"
