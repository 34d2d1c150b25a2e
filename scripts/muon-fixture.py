#!/usr/bin/env python3
"""Fixture for merak's Muon (merak-burn/src/train/optim/tests.rs,
`muon_agrees_with_pytorch`): three steps of PyTorch's `torch.optim.Muon` on a wide `[4, 6]`
and a tall `[6, 4]` matrix from seeded random values and gradients, with Nesterov momentum
0.95, five Newton-Schulz iterations, decoupled weight decay 0.1, the update scaled to match
AdamW's RMS (`adjust_lr_fn="match_rms_adamw"`), and a different learning rate each step.

PyTorch runs its Newton-Schulz iterations in bfloat16. The fixture holds two results: the
step of `torch.optim.Muon` itself (`bf16`), and the same optimizer with its Newton-Schulz
function computing in float32 (`fp32`, everything else unchanged), which merak (float32)
must match within 1e-5. The Rust test reads only this file (CI has no PyTorch).

Usage (a venv with torch >= 2.9):

    python scripts/muon-fixture.py [--out merak-burn/tests/fixtures/muon/torch.json]
"""

import argparse
import json

import torch
import torch.optim._muon as muon_module

SHAPES = {"wide": [4, 6], "tall": [6, 4]}
LRS = [0.02, 0.01, 0.03]
SETTINGS = dict(
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    weight_decay=0.1,
    adjust_lr_fn="match_rms_adamw",
)


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """PyTorch's `_zeropower_via_newtonschulz` without the cast to bfloat16."""
    a, b, c = ns_coefficients
    x = grad.to(dtype=torch.float32, copy=True)
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def run(start, grads):
    """The matrices after each of the steps of `torch.optim.Muon`."""
    params = {k: torch.nn.Parameter(torch.tensor(v).reshape(SHAPES[k])) for k, v in start.items()}
    opt = torch.optim.Muon(list(params.values()), lr=LRS[0], **SETTINGS)
    after = []
    for step, lr in enumerate(LRS):
        for group in opt.param_groups:
            group["lr"] = lr
        for k, p in params.items():
            p.grad = torch.tensor(grads[step][k]).reshape(SHAPES[k])
        opt.step()
        after.append({k: p.detach().flatten().tolist() for k, p in params.items()})
    return after


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="merak-burn/tests/fixtures/muon/torch.json")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(7)
    rand = lambda k: (torch.randn(SHAPES[k], generator=gen) * 0.5).flatten().tolist()
    start = {k: rand(k) for k in SHAPES}
    grads = [{k: rand(k) for k in SHAPES} for _ in LRS]
    bf16 = run(start, grads)
    original = muon_module._zeropower_via_newtonschulz
    muon_module._zeropower_via_newtonschulz = newton_schulz_fp32
    fp32 = run(start, grads)
    muon_module._zeropower_via_newtonschulz = original
    fixture = {
        "torch": torch.__version__,
        "shapes": SHAPES,
        "lrs": LRS,
        "settings": SETTINGS,
        "start": start,
        "grads": grads,
        "fp32": fp32,
        "bf16": bf16,
    }
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
