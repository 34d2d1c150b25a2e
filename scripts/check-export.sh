#!/usr/bin/env bash
# Checks that `merak export` loads in Hugging Face transformers with the same logits and the
# same greedy continuation as merak. Installs torch + transformers into .venv-hf (a few GB;
# not part of CI).
#   bash scripts/check-export.sh [CHECKPOINT] [PROMPT]
# CHECKPOINT defaults to the quickstart's (runs/quickstart/checkpoints).
set -euo pipefail
cd "$(dirname "$0")/.."
ckpt="${1:-runs/quickstart/checkpoints}"
prompt="${2:-It is a truth universally acknowledged}"
out="$(mktemp -d)"
if [ ! -x .venv-hf/bin/python ]; then
  python3 -m venv .venv-hf
  .venv-hf/bin/pip install -q torch transformers safetensors
fi
cargo build --release -q -p merak-launch
target/release/merak export --checkpoint "$ckpt" --output "$out/hf/model.safetensors"
ids="$(target/release/merak generate --checkpoint "$ckpt" --prompt "$prompt" \
  --max-new-tokens 20 --print-ids --logits-out "$out/logits.json" | tail -n 1)"
.venv-hf/bin/python scripts/check-export.py "$out/hf" "$out/logits.json" --expect-ids "$ids"
