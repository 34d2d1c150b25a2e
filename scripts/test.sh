#!/usr/bin/env bash
# The test suite: installs what is missing, checks formatting and lints (with the `cuda` feature,
# which must compile with no GPU or CUDA), and runs every test, including the multi-rank ones
# that spawn mpirun with 1-8 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
export RAYON_NUM_THREADS=1

cargo fmt --all -- --check
# The lints and the CUDA check write only metadata, into a folder of their own: with
# MERAK_LEAN_DISK=1 (CI) it is removed before the test build, so the disk never holds both (a
# CI machine once ran out of space holding both).
target=${CARGO_TARGET_DIR:-target}
check_dir=$target/check
# One pass lints everything with the `cuda` feature on: the CUDA backend and NCCL communicator
# must compile without CUDA installed, and a second pass without the feature would check the
# library and the binary twice (about 3 minutes of CI). The few `cfg(not(feature = "cuda"))`
# lines are compiled, not linted, by the test build below.
CARGO_TARGET_DIR=$check_dir cargo clippy --release --workspace --all-targets \
    --features merak-launch/cuda -- -D warnings
if [ "${MERAK_LEAN_DISK:-0}" = 1 ]; then
    du -sh "$check_dir" || true
    # Only a folder cargo made (it tags its target folders).
    if [ -f "$check_dir/CACHEDIR.TAG" ]; then rm -rf "$check_dir"; fi
fi
cargo test --release --workspace
if [ "${MERAK_LEAN_DISK:-0}" = 1 ]; then
    du -sh "$target" || true
fi
