#!/usr/bin/env python3
"""The planner against measured steps for the user-model examples on 2 ranks.

For each example (`vit-train`, `llama-train`, built with
`cargo build --release -p merak-example-vit -p merak-example-llama`), it runs the example's
`--plan-auto` on 2 ranks with `--plan-report`, which times the model's units as the planner does
and writes every layout the search considered with its predicted step. Then it trains every
layout the example's flags can express (the ZeRO stages of `vit-train`; `reduce_scatter`
"step", the library's default) for a few steps and takes the median step after the first two.
It prints, per example, a Markdown table of predicted against measured steps, and the planner's
choice against the fastest measured layout.

    python3 scripts/plan_user_models.py [--steps 12] [--rounds 2]

Each layout is run `--rounds` times in turn and its fastest round counts (this machine is
shared and noisy). 4 ranks would oversubscribe the 2 cores, so only 2-rank layouts are
measured.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           RAYON_NUM_THREADS="1", NO_COLOR="1")

# The example, its own arguments, the flags it takes for a layout.
EXAMPLES = {
    "vit-train": ([], True),
    "llama-train": (["--global-batch", "16", "--seq", "64"], False),
}


def mpirun(args):
    cmd = ["mpirun", "--oversubscribe", "-np", "2"] + args
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def median_step(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    times = [s["step_time_s"] for s in steps if "step_time_s" in s][2:]
    return statistics.median(times)


def layout_flags(c, zero):
    flags = ["--dp", str(c["dp"]), "--tp", str(c["tp"]), "--pp", str(c["pp"]),
             "--micro-batch", str(c["micro_batch"]), "--schedule", c["schedule"]]
    if zero:
        flags += ["--zero", str(c["zero"])]
    return flags


def key(c):
    return (c["dp"], c["tp"], c["pp"], c["micro_batch"], c["schedule"], c["zero"])


def label(c):
    return (f"dp={c['dp']} tp={c['tp']} pp={c['pp']} mbs={c['micro_batch']} "
            f"{c['schedule']} zero={c['zero']}")


def example(name, extra, zero, steps, rounds, scratch):
    exe = os.path.join(BIN, name)
    report = os.path.join(scratch, f"{name}-report.jsonl")
    chosen_out = os.path.join(scratch, f"{name}-auto")
    base = ["--steps", str(steps)] + extra
    log = mpirun([exe, "--plan-auto", "--plan-report", report, "--out", chosen_out] + base)
    with open(report) as f:
        considered = [json.loads(line) for line in f]
    # The example prints the plan it trains under ("vit: planned dp=1 tp=1 pp=2 ...").
    plan = next((line.split("planned ", 1)[1] for line in log.splitlines() if "planned " in line),
                "(no plan printed)")
    # The examples take no virtual stages: the schedules that need two per rank are left out.
    runnable = [c for c in considered
                if c["reduce_scatter"] == "step" and (zero or c["zero"] == 0)
                and c["schedule"] not in ("zb-v", "interleaved")]
    for c in runnable:
        if c["pp"] == 1:
            # One stage: every schedule runs the same.
            c["schedule"] = "1f1b"
    seen, layouts = set(), []
    for c in runnable:
        if key(c) not in seen:
            seen.add(key(c))
            layouts.append(c)
    measured = {}
    for r in range(rounds):
        for i, c in enumerate(layouts):
            out = os.path.join(scratch, f"{name}-{r}-{i}")
            mpirun([exe, "--out", out] + base + layout_flags(c, zero))
            t = median_step(out)
            measured[key(c)] = min(measured.get(key(c), t), t)
    print(f"\n### {name} ({len(considered)} layouts considered, {len(layouts)} measured)\n")
    print("| layout | predicted (ms) | measured (ms) | error |")
    print("| --- | ---: | ---: | ---: |")
    for c in layouts:
        p, m = c["step_s"] * 1e3, measured[key(c)] * 1e3
        print(f"| {label(c)} | {p:.1f} | {m:.1f} | {100 * (p - m) / m:+.1f}% |")
    best = min(layouts, key=lambda c: measured[key(c)])
    first = layouts[0]
    print(f"\nPlanner's choice: {label(first)} (predicted fastest), measured "
          f"{measured[key(first)] * 1e3:.1f} ms; fastest measured: {label(best)}, "
          f"{measured[key(best)] * 1e3:.1f} ms; ratio **{measured[key(first)] / measured[key(best)]:.3f}**.")
    print(f"(--plan-auto run's plan: {plan}; its own median step "
          f"{median_step(chosen_out) * 1e3:.1f} ms)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=list(EXAMPLES), default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for name, (extra, zero) in EXAMPLES.items():
            if args.only in (None, name):
                example(name, extra, zero, args.steps, args.rounds, scratch)


if __name__ == "__main__":
    main()
