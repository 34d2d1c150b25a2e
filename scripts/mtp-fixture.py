#!/usr/bin/env python3
"""Fixture for merak's multi-token prediction (models/gpt/src/mtp_tests.rs,
`one_mtp_depth_agrees_with_pytorch`): the head unit of a tiny GPT with one MTP depth, written
out in PyTorch from its definition (DeepSeek-V3's MTP with GPT-2's LayerNorm and block):

    main   = CE(ln_f(h) @ wte^T, targets)
    e      = wte[targets]                      (the token one place ahead of each position)
    h1     = block(cat(enorm(e), hnorm(h)) @ proj)
    depth1 = CE(norm(h1) @ wte^T, targets shifted left by one, the last position ignored)
    loss   = main + weight * depth1

from seeded random weights, last hidden states `h` and targets. The fixture holds the weights
(merak's names and layouts: linear weights `[in, out]`, Q, K, V columns), the inputs, both
losses, the total, and the gradients of the total with respect to `h`, `proj` and `wte`. The
Rust test reads only this file (CI has no PyTorch).

Usage (a venv with torch):

    python scripts/mtp-fixture.py [--out models/gpt/tests/fixtures/mtp/torch.json]
"""

import argparse
import json
import math

import torch

VOCAB, HIDDEN, HEADS, BATCH, SEQ = 16, 8, 2, 2, 5
WEIGHT = 0.3
EPS = 1e-5


def layer_norm(x, gamma, beta):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), gamma, beta, EPS)


def attention(x, w):
    b, s, h = x.shape
    d = h // HEADS
    qkv = x @ w["attn.qkv.linear.weight"] + w["attn.qkv.linear.bias"]
    q, k, v = qkv.split(h, dim=-1)
    heads = lambda t: t.view(b, s, HEADS, d).transpose(1, 2)
    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
    return y @ w["attn.proj.linear.weight"] + w["attn.proj.bias"]


def block(x, w):
    x = x + attention(layer_norm(x, w["ln_1.gamma"], w["ln_1.beta"]), w)
    y = layer_norm(x, w["ln_2.gamma"], w["ln_2.beta"])
    y = torch.nn.functional.gelu(y @ w["mlp.fc.linear.weight"] + w["mlp.fc.linear.bias"])
    return x + y @ w["mlp.proj.linear.weight"] + w["mlp.proj.bias"]


def weights(gen):
    """Every weight the head unit reads, by merak name (the depth's block under `mtp.0.block.`)."""
    h = HIDDEN
    normal = lambda *shape, std=0.2: torch.randn(*shape, generator=gen, dtype=torch.float64) * std
    gain = lambda: 1.0 + normal(h, std=0.1)
    w = {"wte.embedding.weight": normal(VOCAB, h, std=0.5)}
    for ln in ["ln_f", "mtp.0.enorm", "mtp.0.hnorm", "mtp.0.norm"]:
        w[f"{ln}.gamma"], w[f"{ln}.beta"] = gain(), normal(h, std=0.1)
    w["mtp.0.proj"] = normal(2 * h, h, std=0.3)
    blk = {
        "ln_1.gamma": gain(),
        "ln_1.beta": normal(h, std=0.1),
        "ln_2.gamma": gain(),
        "ln_2.beta": normal(h, std=0.1),
        "attn.qkv.linear.weight": normal(h, 3 * h, std=0.3),
        "attn.qkv.linear.bias": normal(3 * h, std=0.1),
        "attn.proj.linear.weight": normal(h, h, std=0.3),
        "attn.proj.bias": normal(h, std=0.1),
        "mlp.fc.linear.weight": normal(h, 4 * h, std=0.3),
        "mlp.fc.linear.bias": normal(4 * h, std=0.1),
        "mlp.proj.linear.weight": normal(4 * h, h, std=0.3),
        "mlp.proj.bias": normal(h, std=0.1),
    }
    w.update({f"mtp.0.block.{k}": v for k, v in blk.items()})
    return {k: v.requires_grad_() for k, v in w.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/gpt/tests/fixtures/mtp/torch.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(7)
    w = weights(gen)
    hidden = (torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    wte = w["wte.embedding.weight"]
    ce = lambda x, t: torch.nn.functional.cross_entropy(
        x.reshape(-1, VOCAB), t.reshape(-1), ignore_index=-1
    )
    main_loss = ce(layer_norm(hidden, w["ln_f.gamma"], w["ln_f.beta"]) @ wte.T, targets)
    e = wte[targets]
    x = torch.cat(
        [
            layer_norm(e, w["mtp.0.enorm.gamma"], w["mtp.0.enorm.beta"]),
            layer_norm(hidden, w["mtp.0.hnorm.gamma"], w["mtp.0.hnorm.beta"]),
        ],
        dim=-1,
    ) @ w["mtp.0.proj"]
    blk = {k[len("mtp.0.block."):]: v for k, v in w.items() if k.startswith("mtp.0.block.")}
    h1 = block(x, blk)
    shifted = torch.cat([targets[:, 1:], torch.full((BATCH, 1), -1)], dim=1)
    depth = ce(layer_norm(h1, w["mtp.0.norm.gamma"], w["mtp.0.norm.beta"]) @ wte.T, shifted)
    total = main_loss + WEIGHT * depth
    total.backward()
    flat = lambda t: t.detach().reshape(-1).tolist()
    out = {
        "vocab": VOCAB,
        "hidden": HIDDEN,
        "heads": HEADS,
        "batch": BATCH,
        "seq": SEQ,
        "weight": WEIGHT,
        "eps": EPS,
        "weights": {k: flat(v) for k, v in w.items()},
        "hidden_states": flat(hidden),
        "targets": targets.reshape(-1).tolist(),
        "main": main_loss.item(),
        "depth": depth.item(),
        "total": total.item(),
        "grad": {
            "hidden_states": flat(hidden.grad),
            "mtp.0.proj": flat(w["mtp.0.proj"].grad),
            "wte.embedding.weight": flat(wte.grad),
        },
    }
    with open(args.out, "w") as f:
        json.dump(out, f)
        f.write("\n")
    print(f"wrote {args.out}: main {out['main']:.6f}, depth {out['depth']:.6f}")


if __name__ == "__main__":
    main()
