# Sourced by the GPU scripts (benches/gpu/run.sh, benches/gpu/diagnose.sh): moves to the
# repository root and takes the environment of gpu-bundle/ (the bundled merak, mpirun and their
# libraries), or stops naming the calling script when `scripts/gpu-bundle.sh` has not built it.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
if [ ! -f gpu-bundle/env.sh ]; then
    echo "$0: gpu-bundle/ is missing: run scripts/gpu-bundle.sh first" >&2
    exit 2
fi
# shellcheck disable=SC1091
source gpu-bundle/env.sh
