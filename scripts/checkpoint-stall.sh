#!/usr/bin/env bash
# The step's stall per checkpoint save, synchronous against asynchronous (checkpoint.async),
# and each run's peak memory, side by side: `merak train` under `mpirun -np 2` at dp 2 with
# ZeRO 0 and ZeRO 3, a save every 2 steps.
#
# Usage: scripts/checkpoint-stall.sh [preset] [seq_len] [steps]
#   (defaults: gpt2 = GPT-2 small, 64 tokens per sample, 6 steps: saves after steps 2, 4, 6)
# Needs a release build (cargo build --release -p merak-launch); MERAK=path overrides.
set -euo pipefail
preset=${1:-gpt2}
seq=${2:-64}
steps=${3:-6}
merak=${MERAK:-target/release/merak}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "model.preset=$preset model.seq_len=$seq train.global_batch=2 train.steps=$steps" \
  "checkpoint.every=2, mpirun -np 2, dp 2"
printf '%-5s %-5s | %-28s | %-28s | %-10s | %-11s | %s\n' zero mode "stall per save (s)" \
  "written on the writer (s)" "step (s)" "after save" "peak RSS rank 0 / 1 (MiB)"
for zero in 0 3; do
  for mode in sync async; do
    out="$work/zero$zero-$mode"
    async=false
    [ "$mode" = async ] && async=true
    if ! mpirun -np 2 "$merak" train --dp 2 \
      --set model.preset="$preset" --set model.seq_len="$seq" --set data.kind=synthetic \
      --set train.global_batch=2 --set train.steps="$steps" \
      --set parallel.zero="$zero" --set checkpoint.every=2 --set checkpoint.keep=1 \
      --set checkpoint.async="$async" --out "$out" >"$out.log" 2>&1; then
      echo "zero $zero $mode failed:"; tail -20 "$out.log"; exit 1
    fi
    stalls=$(grep -o 'stall [0-9.]* s' "$out.log" | awk '{print $2}' | paste -sd' ' || true)
    writes=$(grep -o 'written in [0-9.]* s' "$out.log" | awk '{print $3}' | paste -sd' ' || true)
    python3 - "$out" "$zero" "$mode" "$stalls" "${writes:--}" <<'PY'
import json, sys
out, zero, mode, stalls, writes = sys.argv[1:]
steps = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
# Step 1 warms up; the steps right after a save (3, 5) share the cores with the writer.
later = [s["step_time_s"] for s in steps if s["step"] > 1 and s["step"] % 2 == 0]
after = [s["step_time_s"] for s in steps if s["step"] > 1 and s["step"] % 2 == 1]
mean = lambda v: sum(v) / len(v) if v else float("nan")
rss = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in json.load(open(f"{out}/memory.json"))["ranks"])
print(f"{zero:<5} {mode:<5} | {stalls:<28} | {writes:<28} | {mean(later):<10.2f} | {mean(after):<11.2f} | {rss}")
PY
  done
done
echo "stall: time the training thread spent on the save (sync: all of it; async: host copy +"
echo "launch + polls + completion). step: mean of steps 2, 4, ...; after save: steps 3, 5, ..."
