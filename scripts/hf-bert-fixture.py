#!/usr/bin/env python3
"""Fixture for merak's BERT import and export of Hugging Face `BertForMaskedLM`
(models/bert/tests/hf_fixture.rs, launch/tests/bert_hf.rs).

Builds a small BertForMaskedLM with random weights (nothing pretrained; seeded, so the output
is the same on every run with the same torch) of the shape of a tiny merak BERT: vocabulary
101 (odd, so tensor parallelism pads it), hidden 32, 4 heads, 2 layers, MLP width 128, 16
positions, exact GELU, LayerNorm epsilon 1e-12. Every weight, bias and LayerNorm gain is
random except `cls.predictions.bias`, which stays zero (merak's tied head has no output bias,
so a non-zero one is refused); the token type table is random too, so the import's folding of
token type 0 into the positions is exercised. It is saved with `save_pretrained` (fp32
`model.safetensors` + `config.json`), and `expected.json` holds transformers' masked-LM logits
(fp32, eval mode, token type ids 0, no attention mask: merak's BERT has no padding) for a few
fixed batches of token ids. The Rust tests read only these files (CI has no PyTorch).

Usage (the venv with torch and transformers, e.g. /work/.venv-hf/bin/python):

    python scripts/hf-bert-fixture.py [--out models/bert/tests/fixtures/bert-hf]
        Writes the fixture.
    python scripts/hf-bert-fixture.py --check DIR --expected FILE [--tolerance 1e-4]
        Loads the BertForMaskedLM at DIR (e.g. one `merak export` wrote) with transformers and
        compares its logits with FILE: an `expected.json` of this script, or the
        `{"ids", "shape", "logits"}` file `merak export --logits-out` writes. Exits non-zero
        when the largest difference exceeds the tolerance.
"""

import argparse
import json
import os
import sys

import torch
import transformers
from transformers import BertConfig, BertForMaskedLM

CONFIG = dict(
    vocab_size=101,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=16,
    type_vocab_size=2,
    hidden_act="gelu",
    layer_norm_eps=1e-12,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    tie_word_embeddings=True,
)

# (batch, sequence length) of the token id batches.
BATCHES = [(2, 16), (1, 7)]


def randomize(model: BertForMaskedLM, gen: torch.Generator) -> None:
    """Random values everywhere but the output bias (zero)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name == "cls.predictions.bias":
                p.zero_()
            elif "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embeddings" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)


def logits_of(model: BertForMaskedLM, ids: list) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits


def write(out: str) -> None:
    gen = torch.Generator().manual_seed(20240528)
    model = BertForMaskedLM(BertConfig(**CONFIG))
    randomize(model, gen)
    model.eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    cases = []
    for batch, seq in BATCHES:
        ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=gen).tolist()
        logits = logits_of(model, ids)
        cases.append(
            {
                "ids": ids,
                "shape": list(logits.shape),
                "logits": [float(f"{x:.8g}") for x in logits.flatten().tolist()],
            }
        )
    expected = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cases": cases,
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)
    sizes = {n: os.path.getsize(os.path.join(out, n)) for n in sorted(os.listdir(out))}
    print(f"wrote {out}: {sizes}")


def check(folder: str, expected_file: str, tolerance: float) -> int:
    model = BertForMaskedLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    ref = json.load(open(expected_file))
    cases = ref["cases"] if "cases" in ref else [
        {"ids": [ref["ids"]], "shape": [1] + ref["shape"], "logits": ref["logits"]}
    ]
    ok = True
    for case in cases:
        ours = torch.tensor(case["logits"], dtype=torch.float32).reshape(case["shape"])
        theirs = logits_of(model, case["ids"])
        if tuple(theirs.shape) != tuple(ours.shape):
            print(f"shape: transformers {tuple(theirs.shape)}, expected {tuple(ours.shape)}")
            ok = False
            continue
        diff = (theirs - ours).abs().max().item()
        same_argmax = bool((theirs.argmax(-1) == ours.argmax(-1)).all())
        print(
            f"{tuple(ours.shape)} logits: max |transformers - expected| = {diff:.3e} "
            f"(largest logit {ours.abs().max().item():.3f}); same arg-max everywhere: {same_argmax}"
        )
        ok = ok and diff <= tolerance and same_argmax
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="models/bert/tests/fixtures/bert-hf")
    p.add_argument("--check", default=None, help="a BertForMaskedLM folder to check")
    p.add_argument("--expected", default=None)
    p.add_argument("--tolerance", type=float, default=1e-4)
    a = p.parse_args()
    if a.check:
        if not a.expected:
            p.error("--check needs --expected")
        return check(a.check, a.expected, a.tolerance)
    write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
