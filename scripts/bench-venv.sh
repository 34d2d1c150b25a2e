#!/usr/bin/env bash
# Creates .venv-bench with PyTorch and numpy for `bench-vs-pytorch` (the PyTorch side of the
# comparison). PyPI's Linux wheel of torch also pulls NVIDIA's CUDA libraries (a few GB); the
# benchmark uses only its CPU kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-bench/bin/python ] || python3 -m venv .venv-bench
.venv-bench/bin/pip install -q torch numpy
.venv-bench/bin/python -c "import torch; print('torch', torch.__version__)"
