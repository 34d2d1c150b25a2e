#!/usr/bin/env bash
# Checks that `merak export` loads in Hugging Face transformers with the same logits as merak:
# a GPT checkpoint as GPT2LMHeadModel (logits of the prompt and the same greedy continuation),
# a BERT checkpoint as BertForMaskedLM (masked-LM logits of fixed ids, some of them [MASK]).
# Uses the venv at $HF_VENV (default .venv-hf), installing torch + transformers into it when it
# has no python (a few GB; not part of CI).
#   bash scripts/check-export.sh [CHECKPOINT] [PROMPT]
#   HF_VENV=/work/.venv-hf bash scripts/check-export.sh runs/bert/checkpoints
# CHECKPOINT defaults to the quickstart's (runs/quickstart/checkpoints); PROMPT is for GPTs.
set -euo pipefail
cd "$(dirname "$0")/.."
ckpt="${1:-runs/quickstart/checkpoints}"
prompt="${2:-It is a truth universally acknowledged}"
venv="${HF_VENV:-.venv-hf}"
out="$(mktemp -d)"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch transformers safetensors
fi
cargo build --release -q -p merak-launch
target/release/merak export --checkpoint "$ckpt" --output "$out/hf/model.safetensors" \
  --logits-out "$out/export-logits.json"
kind="$("$venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["model_type"])' \
  "$out/hf/config.json")"
if [ "$kind" = bert ]; then
  "$venv/bin/python" scripts/check-export.py "$out/hf" "$out/export-logits.json"
  exit
fi
ids="$(target/release/merak generate --checkpoint "$ckpt" --prompt "$prompt" \
  --max-new-tokens 20 --print-ids --logits-out "$out/logits.json" | tail -n 1)"
"$venv/bin/python" scripts/check-export.py "$out/hf" "$out/logits.json" --expect-ids "$ids"
