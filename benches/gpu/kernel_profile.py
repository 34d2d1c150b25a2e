#!/usr/bin/env python3
"""Summarises CubeCL's profiling log (one line `| <duration> | <kernel>` per launch).

    python3 benches/gpu/kernel_profile.py RESULTS/cubecl-profile.log.gz --steps 4 [--top 30]

Under profiling, CubeCL synchronises before and after every launch and times it on the host,
so a launch's time is the kernel's run plus the launch and the synchronisation (a few
microseconds); the first launch of each kernel also includes NVRTC's compilation, so it is
left out. The per-step figures divide the rest by --steps (the profiled run's steps).
Prints Markdown: the kernels by total time, then the same grouped by kind.
"""

import argparse
import gzip
import re
import sys
from collections import defaultdict

UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
LINE = re.compile(r"^\|\s*([0-9.]+)(s|ms|µs|us|ns)\s*\|\s*(.+?)\s*$")

# Kinds of kernel, by words in CubeCL's and Burn's kernel names (first match wins).
KINDS = [
    ("matrix product", r"matmul|cmma|gemm|mma"),
    ("reduction (sum, max, mean, argmax)", r"reduce|sum|mean|argmax|max_dim|prod"),
    ("copy or layout (contiguous, slice, cat, gather, scatter)",
     r"contiguous|copy|slice|cat|gather|scatter|select|permute|swap|expand|repeat|index"),
    ("cast", r"cast|convert|into_"),
    ("random", r"random|bernoulli|uniform|normal"),
    ("element-wise", r"elemwise|binary|unary|clamp|mask|exp|log|sqrt|powf|tanh|erf|div|mul|add|sub"),
]


def parse(path):
    """Yields (seconds, kernel name) for each launch in the log (plain or gzipped)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            # A launch's line starts with its duration; the summary tables' rows start with
            # a name, so they do not match. Names may hold bars ("KernelBinop | MulOp").
            m = LINE.match(line.strip())
            if m:
                name = " ".join(part.strip() for part in m.group(3).split("|") if part.strip())
                yield float(m.group(1)) * UNITS[m.group(2)], name


def kind_of(name):
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--steps", type=int, required=True, help="steps in the profiled run")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    totals = defaultdict(float)
    counts = defaultdict(int)
    first = {}
    for seconds, name in parse(a.log):
        if name not in first:
            first[name] = seconds  # includes NVRTC's compilation
            continue
        totals[name] += seconds
        counts[name] += 1
    if not totals:
        sys.exit(f"{a.log}: no profiled launches found")
    whole = sum(totals.values())
    launches = sum(counts.values())
    print(f"Profiled launches (first of each kernel left out): {launches}, "
          f"{launches / a.steps:.0f} a step; their time {whole / a.steps * 1e3:.1f} ms a step; "
          f"{len(first)} distinct kernels, whose first launches took {sum(first.values()):.1f} s.")
    print()
    print("| kernel | launches a step | ms a step | mean µs | share |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in sorted(totals, key=totals.get, reverse=True)[: a.top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        print(f"| `{short}` | {counts[name] / a.steps:.0f} | {totals[name] / a.steps * 1e3:.2f} | "
              f"{totals[name] / counts[name] * 1e6:.1f} | {totals[name] / whole:.1%} |")
    print()
    by_kind = defaultdict(float)
    kind_count = defaultdict(int)
    for name, t in totals.items():
        by_kind[kind_of(name)] += t
        kind_count[kind_of(name)] += counts[name]
    print("| kind | launches a step | ms a step | share |")
    print("| --- | ---: | ---: | ---: |")
    for kind in sorted(by_kind, key=by_kind.get, reverse=True):
        print(f"| {kind} | {kind_count[kind] / a.steps:.0f} | {by_kind[kind] / a.steps * 1e3:.1f} | "
              f"{by_kind[kind] / whole:.1%} |")


if __name__ == "__main__":
    main()
