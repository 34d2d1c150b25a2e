#!/usr/bin/env bash
# Installs what merak-burn needs to build and run on Debian/Ubuntu, if it is missing:
# Open MPI (library, headers, mpirun), libclang (the `mpi` crate generates its bindings with it),
# pkg-config, procps (pgrep, used by a test), python3 (the GPU report's test runs
# benches/gpu/report.py) and Mesa's Vulkan drivers with the Vulkan loader (the `wgpu` device's
# tests run on its software driver, llvmpipe). Needs a Rust toolchain (https://rustup.rs).
set -euo pipefail

need=()
for pkg in libopenmpi-dev openmpi-bin libclang-dev clang pkg-config procps python3 mesa-vulkan-drivers libvulkan1; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }

# Open MPI refuses to run as root unless told; containers and CI run as root.
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
