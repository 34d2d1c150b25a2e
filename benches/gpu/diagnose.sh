#!/usr/bin/env bash
# Finds why a CubeCL kernel fails on CUDA, on the GPU machine, from the repository root, after
# `scripts/gpu-bundle.sh` built gpu-bundle/ here and it travelled with the tree:
#
#   bash benches/gpu/diagnose.sh KERNEL...      # e.g. xent adamw
#
# For each kernel (attention, gelu, norm, xent, embedding, adamw, squares) it trains the tiny
# GPT on CUDA with only that kernel fused (MERAK_COMPOSED_KERNELS names the others):
#   KERNEL-source.log     CubeCL's compilation log: the generated CUDA source of every kernel
#                         (CUBECL_DEBUG_LOG; no PTX cache, so every kernel is compiled)
#   KERNEL-memcheck.log   compute-sanitizer's memcheck: out-of-bounds and misaligned accesses,
#                         with the kernel, the thread and the address
#   KERNEL-initcheck.log  compute-sanitizer's initcheck: reads of memory never written
#   KERNEL-racecheck.log  compute-sanitizer's racecheck: shared-memory races
# into RESULTS (default runs/gpu-diagnose). TOOLS (default "memcheck initcheck racecheck") names
# the sanitizer's tools to run (set and empty: none, only the source). Each run trains STEPS
# (default 2) steps under RUN_LIMIT_S (default 120) seconds.
set -uo pipefail
# shellcheck source=benches/gpu/bundle.sh
source "$(dirname "$0")/bundle.sh"
out=${RESULTS:-runs/gpu-diagnose}
limit=${RUN_LIMIT_S:-120}
steps=${STEPS:-2}
sanitizer=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
names=(attention gelu norm xent embedding adamw squares)
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ -e cubecl.toml ]; then
    echo "benches/gpu/diagnose.sh: a cubecl.toml would load cached kernels; move it away" >&2
    exit 2
fi
tiny=(--config configs/gpt-tiny.toml --set train.device=cuda --set train.steps="$steps"
    --set checkpoint.at_end=false)
for k in "$@"; do
    others=$(printf '%s\n' "${names[@]}" | grep -vx "$k" | paste -sd, -)
    export MERAK_COMPOSED_KERNELS=$others
    CUBECL_DEBUG_LOG="$out/$k-source.log" timeout "$limit" merak train "${tiny[@]}" \
        --out "$out/$k-source" --replace >"$out/$k-run.log" 2>&1
    echo "$k source: exit $?"
    for tool in ${TOOLS-memcheck initcheck racecheck}; do
        timeout "$limit" "$sanitizer" --tool "$tool" --print-limit 20 merak train "${tiny[@]}" \
            --out "$out/$k-$tool" --replace >"$out/$k-$tool.log" 2>&1
        echo "$k $tool: exit $?"
    done
done
