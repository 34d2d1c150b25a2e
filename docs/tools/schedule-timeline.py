#!/usr/bin/env python3
"""Draws the timeline of a simulated pipeline step as an SVG, from the Chrome trace that
`merak schedule --trace` writes (unit costs: forward 1, backward 2).

    target/release/merak schedule --schedule 1f1b --pp 4 --micro-batches 8 --trace t.json
    python3 docs/tools/schedule-timeline.py t.json "1F1B" > docs/src/images/schedule-1f1b.svg

One row per rank; each forward, backward (B), weight-gradient (W) and recompute box is labelled
with its micro-batch; a second stage on a rank (interleaved, ZB-V, DualPipeV) is drawn in a
darker shade, the next step's micro-batches (2BW) with an outline. A DualPipeV pair is one box
with a thick outline: its forward in the left half, its backward (B) in the right half (equal
under these unit costs, F = B = 1 per rank). Empty space is the bubble.
"""
import json
import re
import sys

UNIT = 1_000_000.0  # the trace's microseconds per simulated unit
PX = 14  # pixels per unit
ROW = 26
LEFT = 58
TOP = 26
COLOURS = {  # category -> (first stage on the rank, second stage)
    "forward": ("#9ecae1", "#4292c6"),
    "backward": ("#a1d99b", "#41ab5d"),
    "weight": ("#fdd0a2", "#fd8d3c"),
    "recompute": ("#dadaeb", "#9e9ac8"),
}
NAME = re.compile(r"\w+\(mb=(\d+), stage=(\d+)\) \[step (\d+)\]")
PAIR = re.compile(
    r"ForwardBackward\(forward mb=(\d+), stage=(\d+); backward mb=(\d+), stage=(\d+)\) \[step (\d+)\]"
)


def halves(events):
    """Each pair event as its forward and backward halves (the rest unchanged)."""
    out = []
    for e in events:
        m = PAIR.match(e["name"])
        if e.get("cat") != "forward+backward" or not m:
            out.append(e)
            continue
        fmb, fst, bmb, bst, step = m.groups()
        half = e["dur"] / 2
        out.append(dict(e, cat="forward", dur=half, pair="left",
                        name=f"Forward(mb={fmb}, stage={fst}) [step {step}]"))
        out.append(dict(e, cat="backward", ts=e["ts"] + half, dur=half, pair="right",
                        name=f"Backward(mb={bmb}, stage={bst}) [step {step}]"))
    return out


def main(path, title):
    events = halves(json.load(open(path))["traceEvents"])
    boxes = [e for e in events if e.get("ph") == "X" and e.get("cat") in COLOURS and e["dur"] > 0]
    ranks = 1 + max(e["tid"] for e in boxes)
    end = max(e["ts"] + e["dur"] for e in boxes) / UNIT
    first_stage = {}
    for e in boxes:
        m = NAME.match(e["name"])
        stage = int(m.group(2))
        first_stage[e["tid"]] = min(first_stage.get(e["tid"], stage), stage)
    # The legend (about 6 px per character) goes under the rows, its time note on a line of
    # its own.
    width = max(LEFT + end * PX + 10, 560)
    height = TOP + ranks * ROW + 50
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height}" '
        f'width="{width:.0f}" height="{height}" font-family="sans-serif" font-size="10">',
        f'<rect width="100%" height="100%" fill="white"/>',
        f'<text x="4" y="16" font-size="12" font-weight="bold">{title}</text>',
    ]
    for r in range(ranks):
        y = TOP + r * ROW
        out.append(f'<text x="4" y="{y + 16}">rank {r}</text>')
        out.append(
            f'<rect x="{LEFT}" y="{y}" width="{end * PX:.1f}" height="{ROW - 4}" fill="#f4f4f4"/>'
        )
    outlines = []
    for e in boxes:
        m = NAME.match(e["name"])
        mb, stage, step = int(m.group(1)), int(m.group(2)), int(m.group(3))
        shade = COLOURS[e["cat"]][0 if stage == first_stage[e["tid"]] else 1]
        x = LEFT + e["ts"] / UNIT * PX
        w = e["dur"] / UNIT * PX
        y = TOP + e["tid"] * ROW
        stroke = ' stroke="black" stroke-width="1.5"' if step > 0 else ' stroke="white" stroke-width="0.5"'
        out.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{ROW - 4}" fill="{shade}"{stroke}/>'
        )
        out.append(f'<text x="{x + w / 2:.1f}" y="{y + 15}" text-anchor="middle">{mb}</text>')
        if e.get("pair") == "left":
            outlines.append(
                f'<rect x="{x:.1f}" y="{y + 1}" width="{2 * w:.1f}" height="{ROW - 6}" fill="none" '
                f'stroke="black" stroke-width="1.5"/>'
            )
    out.extend(outlines)
    y = TOP + ranks * ROW + 14
    x = LEFT
    split = any(e["cat"] == "weight" for e in boxes)
    for cat, label in [("forward", "forward"), ("backward", "backward (B)" if split else "backward"),
                       ("weight", "weight gradients (W)"), ("recompute", "recompute")]:
        if any(e["cat"] == cat for e in boxes):
            out.append(f'<rect x="{x}" y="{y - 9}" width="12" height="12" fill="{COLOURS[cat][0]}"/>')
            out.append(f'<text x="{x + 16}" y="{y + 1}">{label}</text>')
            x += 22 + 6 * len(label)
    note = "; thick outline: a forward-backward pair" if any(e.get("pair") for e in boxes) else ""
    out.append(f'<text x="{LEFT}" y="{y + 20}">time: {end:g} (a forward pass takes 1){note}</text>')
    out.append("</svg>")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
