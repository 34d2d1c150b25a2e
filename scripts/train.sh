#!/usr/bin/env bash
# Quickstart: installs what is missing, builds, fetches a public-domain text (Jane Austen's
# novels, from a Debian package), tokenizes it with GPT-2's BPE, and trains a small GPT on 4 MPI
# ranks (dp=2 x tp=2) for a few minutes, then prints a generated sample. Extra arguments go to
# `merak train` (for example: --set train.steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
if ! command -v python3 >/dev/null; then   # fetch-text.sh reads the package's data with python3
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -qq python3 >/dev/null
fi
cargo build --release -p merak-launch
bash scripts/fetch-text.sh data/raw/book.txt
if [ ! -s data/text/meta.json ]; then
  target/release/merak prepare-data --input data/raw/book.txt --output data/text
fi
# A new folder each time: a run never writes into another run's folder.
out="runs/quickstart-$(date -u +%Y%m%d-%H%M%S)"
mpirun --oversubscribe --bind-to none -np 4 target/release/merak train \
  --config configs/gpt-mini-text.toml --dp 2 --tp 2 --out "$out" "$@"
echo "metrics: $out/metrics.jsonl, loss curve: $out/loss.svg"
echo "checkpoint: $out/checkpoints; try:"
echo "  target/release/merak generate --checkpoint $out/checkpoints --prompt 'It is a truth' --max-new-tokens 40"
echo "  target/release/merak export --checkpoint $out/checkpoints --output $out/hf/model.safetensors"
