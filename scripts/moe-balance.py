#!/usr/bin/env python3
"""Compares the experts' balancing per sequence (the default) with balancing per micro-batch.

Trains the `moe-tiny` preset on `configs/gpt-tiny.toml`'s synthetic data (seed 11) with
`model.moe.balance = "sequence"` and `"micro-batch"`, each on one process and at `--dp 2`,
with `train.micro_batch` at its default (a rank's whole share: 8 sequences on one process, 4 at
dp 2), and prints, from each run's `metrics.jsonl`, the loss, the auxiliary loss and the most
loaded expert over the mean (worst layer) at some steps, and the largest difference between
each form's one-process and dp = 2 losses.

    cargo build --release -p merak-launch
    python3 scripts/moe-balance.py [--steps 300] [--out /tmp/moe-balance]

Needs `mpirun` for the dp = 2 runs. Standard library only.
"""
import argparse
import json
import os
import subprocess
import sys

MERAK = os.path.join(os.path.dirname(__file__), "..", "target", "release", "merak")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "gpt-tiny.toml")


def train(out, balance, dp, steps):
    """Trains one run into `out` and returns its metrics records (one a step)."""
    cmd = [MERAK, "train", "--config", CONFIG, "--out", out]
    if dp > 1:
        cmd = ["mpirun", "-np", str(dp), "--oversubscribe", "--bind-to", "none"] + cmd
        cmd += ["--dp", str(dp)]
    for s in [
        "model.preset=moe-tiny",
        f'model.moe.balance="{balance}"',
        "data.kind=synthetic",
        f"train.steps={steps}",
        "train.seed=11",
        "checkpoint.every=0",
    ]:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if "expert_max_load" in r]


def mean(xs):
    return sum(xs) / max(len(xs), 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="/tmp/moe-balance")
    a = p.parse_args()
    runs = {}
    for balance in ["sequence", "micro-batch"]:
        for dp in [1, 2]:
            out = os.path.join(a.out, f"{balance}-dp{dp}")
            if os.path.exists(out):
                sys.exit(f"{out} exists: choose another --out")
            runs[(balance, dp)] = train(out, balance, dp, a.steps)
    marks = [1, 10, 50, 100, 200, a.steps]
    print("| balance | step | loss | aux_loss | expert_max_load |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for balance in ["sequence", "micro-batch"]:
        m = runs[(balance, 1)]
        for step in marks:
            r = m[step - 1]
            print(
                f"| {balance} | {step} | {r['loss']:.4f} | {r['aux_loss']:.5f} "
                f"| {r['expert_max_load']:.3f} |"
            )
    print()
    print("| balance | mean loss, last 50 steps | mean max load | worst max load, after step 50 "
          "| largest loss difference, dp 2 against 1 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for balance in ["sequence", "micro-batch"]:
        one, two = runs[(balance, 1)], runs[(balance, 2)]
        last = mean([r["loss"] for r in one[-50:]])
        load = mean([r["expert_max_load"] for r in one])
        worst = max(r["expert_max_load"] for r in one[50:])
        diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(one, two))
        print(f"| {balance} | {last:.4f} | {load:.3f} | {worst:.3f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
