#!/usr/bin/env python3
"""Counted against planned model states, and the measured peak against the admission check's
estimate, of the tiny GPT on the layouts of the book's table (docs/src/concepts/zero.md).

Runs `merak train` (target/release/merak, or $MERAK) for each layout in a scratch folder and
prints a Markdown table. Needs mpirun; takes about a minute on 2 cores.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MERAK = os.environ.get("MERAK", os.path.join(ROOT, "target", "release", "merak"))
CONFIG = os.path.join(ROOT, "configs", "gpt-tiny.toml")
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=64"]

# (name, ranks, flags, --set keys)
LAYOUTS = [
    ("dp 2", 2, ["--dp", "2"], []),
    ("dp 2, ZeRO-1", 2, ["--dp", "2"], ["parallel.zero=1"]),
    ("dp 2, ZeRO-2", 2, ["--dp", "2"], ["parallel.zero=2"]),
    ("dp 2, ZeRO-2, micro-batch", 2, ["--dp", "2"],
     ["parallel.zero=2", "parallel.reduce_scatter=micro-batch"]),
    ("dp 2, ZeRO-3", 2, ["--dp", "2"], ["parallel.zero=3"]),
    ("dp 2, ZeRO-3, step", 2, ["--dp", "2"],
     ["parallel.zero=3", "parallel.reduce_scatter=step"]),
    ("dp 4, ZeRO-3, shard 2", 4, ["--dp", "4"], ["parallel.zero=3", "parallel.shard=2"]),
    ("cp 2", 2, ["--cp", "2"], []),
    ("dp 2, ep 2 (MoE)", 2, ["--dp", "2"], ["parallel.ep=2"] + MOE),
    ("dp 4, ep 2, ZeRO-1 (MoE)", 4, ["--dp", "4"], ["parallel.ep=2", "parallel.zero=1"] + MOE),
    ("dp 4, ep 2, ZeRO-1, shard 2 (MoE)", 4, ["--dp", "4"],
     ["parallel.ep=2", "parallel.zero=1", "parallel.shard=2"] + MOE),
]

ESTIMATE = re.compile(
    r"memory: estimated peak of the busiest rank [0-9.]+ MiB \(model states ([0-9.]+), "
    r"activations ([0-9.]+)")


def run(scratch, index, ranks, flags, sets):
    out = os.path.join(scratch, f"run-{index}")
    cmd = [MERAK, "train", "--np", str(ranks), "--config", CONFIG, "--out", out]
    cmd += flags
    for kv in ["train.steps=2", "data.kind=synthetic", "checkpoint.at_end=false"] + sets:
        cmd += ["--set", kv]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               RAYON_NUM_THREADS="1", NO_COLOR="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    estimate = ESTIMATE.search(done.stdout + done.stderr)
    with open(os.path.join(out, "memory.json")) as f:
        memory = json.load(f)
    # The estimate without the runtime's fixed bytes: what the allocator's mark compares with.
    held = float(estimate.group(1)) + float(estimate.group(2)) if estimate else None
    return memory["ranks"], held


def main():
    values = lambda mib: round(mib * (1 << 20) / 4)
    print("| layout | weights counted / planned | gradients | optimizer state "
          "| estimated states + activations (MiB) | allocator peak, busiest rank (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, ranks, flags, sets) in enumerate(LAYOUTS):
            per_rank, estimate = run(scratch, index, ranks, flags, sets)
            r = per_rank[0]
            cells = [
                f"{values(r[k + '_mib']):,} / {values(r['planned_' + k + '_mib']):,}"
                for k in ("param", "grad", "optimizer")
            ]
            peak = max(x["alloc_peak_mib"] or 0.0 for x in per_rank)
            est = f"{estimate:.2f}" if estimate is not None else "n/a"
            print(f"| {name} | {' | '.join(cells)} | {est} | {peak:.1f} |")


if __name__ == "__main__":
    main()
