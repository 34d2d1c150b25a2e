# Sourced by the GPU scripts (benches/gpu/run.sh, benches/gpu/diagnose.sh): moves to the
# repository root and takes the environment of gpu-bundle/ (the bundled merak, mpirun and their
# libraries), or stops naming the calling script when `scripts/gpu-bundle.sh` has not built it.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
if [ "${DRY_RUN:-0}" = 1 ] && { [ -n "${DRY_RUN_BIN:-}" ] || [ ! -f gpu-bundle/env.sh ]; }; then
    # A dry run on this machine (benches/gpu/run.sh): the merak in DRY_RUN_BIN, or built here.
    bin=${DRY_RUN_BIN:-$PWD/target/release}
    if [ ! -x "$bin/merak" ]; then
        echo "$0: DRY_RUN=1 needs $bin/merak (cargo build --release)" >&2
        exit 2
    fi
    export PATH="$bin:$PATH"
    return 0 2>/dev/null || exit 0
fi
if [ ! -f gpu-bundle/env.sh ]; then
    echo "$0: gpu-bundle/ is missing: run scripts/gpu-bundle.sh first" >&2
    exit 2
fi
# A bundle built from other sources than this tree's measures other code: said before the runs.
tree_sources=$(scripts/source-fingerprint.sh 2>/dev/null || echo unknown)
if [ "$(cat gpu-bundle/SOURCES 2>/dev/null || echo none)" != "$tree_sources" ]; then
    echo "$0: WARNING: gpu-bundle/ was not built from this tree's sources (gpu-bundle/SOURCES" \
        "against scripts/source-fingerprint.sh): rebuild it with scripts/gpu-bundle.sh" >&2
fi
# shellcheck disable=SC1091
source gpu-bundle/env.sh
