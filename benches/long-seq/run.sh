#!/usr/bin/env bash
# Memory and speed against the sequence length (issue 31, item 7): the tiny GPT (2 layers,
# hidden 64, 4 heads), one sequence per step, 4 steps, at each length in LENGTHS, for each
# `NAME=binary` or `NAME=binary:merak train flags` given (run under `mpirun -np NP` when NP > 1).
# Prints per run the median tokens/s after the first step, the largest allocator high-water
# mark and peak resident memory of any rank (`memory.json`), next to the planner's activation
# formula (Korthikanti et al. 2022; docs/src/contributing/architecture.md, "Activation memory")
# in fp32 (twice its 16-bit bytes) per rank: with the softmax kept,
# s*b*h*(34 + 5*a*s/h)*2 per layer; blockwise, without the 5*a*s/h term; with TP degree t,
# s*b*h*(10 + 24/t) without sequence parallelism and s*b*h*34/t with it; with context
# parallelism (--cp c) s/c tokens per rank. The TP and CP degrees are read from the flags
# (--tp N, --cp N, parallel.sequence_parallel=true). A run that fails
# (out of memory, or over TIMEOUT_S) prints its exit status.
#
#   bash benches/long-seq/run.sh NAME=path/to/merak [NAME=path/to/merak ...]
#   LENGTHS="1024 4096 16384" TIMEOUT_S=900 bash benches/long-seq/run.sh new=target/release/merak
#   NP=2 LENGTHS="4096 16384" bash benches/long-seq/run.sh \
#     tp2="target/release/merak:--tp 2" \
#     tp2-sp="target/release/merak:--tp 2 --set parallel.sequence_parallel=true"
set -uo pipefail
LENGTHS=${LENGTHS:-"1024 2048 4096 8192 16384"}
TIMEOUT_S=${TIMEOUT_S:-600}
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1}
printf '%-10s %6s %10s %12s %10s %16s %16s\n' build seq tokens/s alloc_MiB rss_MiB formula_kept_MiB formula_block_MiB
for s in $LENGTHS; do
  for spec in "$@"; do
    name=${spec%%=*}
    run=${spec#*=}
    bin=${run%%:*}
    flags=""
    [[ $run == *:* ]] && flags=${run#*:}
    launch=()
    NP=${NP:-1}
    [[ $NP -gt 1 ]] && launch=(mpirun --oversubscribe -np "$NP")
    out=$(mktemp -d)
    # shellcheck disable=SC2086 # the flags are words
    timeout "$TIMEOUT_S" "${launch[@]}" "$bin" train --set model.seq_len="$s" \
      --set train.global_batch=1 --set train.steps=4 --set checkpoint.at_end=false \
      $flags --out "$out" >"$out/log" 2>&1
    rc=$?
    tp=1
    [[ $flags =~ --tp[[:space:]]+([0-9]+) ]] && tp=${BASH_REMATCH[1]}
    cp=1
    [[ $flags =~ --cp[[:space:]]+([0-9]+) ]] && cp=${BASH_REMATCH[1]}
    sp=0
    [[ $flags == *sequence_parallel=true* ]] && sp=1
    python3 - "$out" "$name" "$s" "$rc" "$tp" "$sp" "$cp" <<'PY'
import json, statistics, sys
out, name, s, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t, sp, cp = int(sys.argv[5]), sys.argv[6] == "1", int(sys.argv[7])
b, h, a, layers = 1, 64, 4, 2
per_token = 34 / t if sp else 10 + 24 / t
# Each rank holds s / cp tokens; the kept scores would be its queries against all keys.
kept = layers * s / cp * b * h * (per_token + 5 * a * s / (h * t)) * 2 / 2**20
block = layers * s / cp * b * h * per_token * 2 / 2**20
if rc != 0:
    print(f"{name:<10} {s:>6} {'exit ' + str(rc):>10} {'-':>12} {'-':>10} {kept:>16.0f} {block:>16.0f}")
    sys.exit()
speeds = [json.loads(l)["tokens_per_s"] for l in open(f"{out}/metrics.jsonl")][1:]
ranks = json.load(open(f"{out}/memory.json"))["ranks"]
alloc = max(r["alloc_peak_mib"] for r in ranks)
rss = max(r["peak_rss_mib"] for r in ranks)
print(f"{name:<10} {s:>6} {statistics.median(speeds):>10.0f} {alloc:>12.1f} "
      f"{rss:>10.0f} {kept:>16.0f} {block:>16.0f}")
PY
    rm -rf "$out"
  done
done
