#!/usr/bin/env bash
# Memory and speed of one process against the sequence length (issue 31, item 7, cp = 1 and
# no sequence parallelism): the tiny GPT (2 layers, hidden 64, 4 heads), one sequence per step,
# 4 steps, at each length in LENGTHS, for each `merak` binary given. Prints per run the median
# tokens/s after the first step, the allocator's high-water mark and peak resident memory
# (`memory.json`), next to the activation formula of DESIGN.md section 5 in fp32 (twice its
# 16-bit bytes): with the softmax kept, s*b*h*(34 + 5*a*s/h)*2 per layer; blockwise, without
# the 5*a*s/h term. A run that fails (out of memory, or over TIMEOUT_S) prints its exit status.
#
#   bash benches/long-seq/run.sh NAME=path/to/merak [NAME=path/to/merak ...]
#   LENGTHS="1024 4096 16384" TIMEOUT_S=900 bash benches/long-seq/run.sh new=target/release/merak
set -uo pipefail
LENGTHS=${LENGTHS:-"1024 2048 4096 8192 16384"}
TIMEOUT_S=${TIMEOUT_S:-600}
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1}
printf '%-10s %6s %10s %12s %10s %16s %16s\n' build seq tokens/s alloc_MiB rss_MiB formula_kept_MiB formula_block_MiB
for s in $LENGTHS; do
  for spec in "$@"; do
    name=${spec%%=*}
    bin=${spec#*=}
    out=$(mktemp -d)
    timeout "$TIMEOUT_S" "$bin" train --set model.seq_len="$s" --set train.global_batch=1 \
      --set train.steps=4 --set checkpoint.at_end=false --out "$out" >"$out/log" 2>&1
    rc=$?
    python3 - "$out" "$name" "$s" "$rc" <<'PY'
import json, statistics, sys
out, name, s, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
b, h, a, layers = 1, 64, 4, 2
kept = layers * s * b * h * (34 + 5 * a * s / h) * 2 / 2**20
block = layers * s * b * h * 34 * 2 / 2**20
if rc != 0:
    print(f"{name:<10} {s:>6} {'exit ' + str(rc):>10} {'-':>12} {'-':>10} {kept:>16.0f} {block:>16.0f}")
    sys.exit()
speeds = [json.loads(l)["tokens_per_s"] for l in open(f"{out}/metrics.jsonl")][1:]
r = json.load(open(f"{out}/memory.json"))["ranks"][0]
print(f"{name:<10} {s:>6} {statistics.median(speeds):>10.0f} {r['alloc_peak_mib']:>12.1f} "
      f"{r['peak_rss_mib']:>10.0f} {kept:>16.0f} {block:>16.0f}")
PY
    rm -rf "$out"
  done
done
