#!/usr/bin/env bash
# Prints one SHA-256 of the sources the GPU bundle's binaries are built from (the Rust files and
# manifests of merak-burn, merak-plan, launch, models and vendor, and the workspace's Cargo.toml
# and Cargo.lock), without git: the GPU machine's copy of the tree has none. scripts/gpu-bundle.sh
# records it in the bundle; benches/gpu/bundle.sh compares it with the tree's, so a bundle built
# from other sources is named before any device minute is spent on it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
{
    find merak-burn merak-plan launch models vendor -type f \
        \( -name '*.rs' -o -name Cargo.toml -o -name '*.diff' \) -print
    printf '%s\n' Cargo.toml Cargo.lock
} | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
