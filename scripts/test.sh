#!/usr/bin/env bash
# The test suite: installs what is missing, checks formatting and lints, checks that the `cuda`
# feature compiles (no GPU or CUDA needed), and runs every test, including the multi-rank ones
# that spawn mpirun with 1-8 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
export RAYON_NUM_THREADS=1

cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings
# The CUDA backend and NCCL communicator must compile without CUDA installed.
cargo check --release -p merak-launch --features cuda
cargo test --release --workspace
