#!/usr/bin/env python3
"""Checks a `merak export` against Hugging Face transformers.

Loads the exported folder with `GPT2LMHeadModel.from_pretrained` (a GPT export) or
`BertForMaskedLM.from_pretrained` (a BERT export: `model_type` "bert" in its config.json),
runs the ids of LOGITS_JSON (written by `merak generate --logits-out FILE` or
`merak export --logits-out FILE`), and compares the logits at every position.

    python3 scripts/check-export.py EXPORT_FOLDER LOGITS_JSON [--tolerance 1e-4] [--expect-ids IDS]

With --expect-ids (the last line of `merak generate --print-ids`, greedy; GPT only),
transformers' greedy `generate` must produce the same ids.

Needs torch and transformers (`pip install torch transformers safetensors`). Exits non-zero
when the largest difference, relative to the largest logit, exceeds the tolerance.
"""
import argparse
import json
import os
import sys

import torch
from transformers import BertForMaskedLM, GPT2LMHeadModel


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("logits")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--expect-ids", default=None)
    a = p.parse_args()

    with open(os.path.join(a.folder, "config.json")) as f:
        kind = json.load(f).get("model_type")
    if kind == "bert" and a.expect_ids:
        p.error("--expect-ids: a BERT does not generate")
    cls = BertForMaskedLM if kind == "bert" else GPT2LMHeadModel
    model = cls.from_pretrained(a.folder, dtype=torch.float32)
    model.eval()
    ref = json.load(open(a.logits))
    n, vocab = ref["shape"]
    ours = torch.tensor(ref["logits"], dtype=torch.float32).reshape(n, vocab)
    ids = torch.tensor([ref["ids"]], dtype=torch.long)
    with torch.no_grad():
        theirs = model(ids).logits[0]
    if tuple(theirs.shape) != (n, vocab):
        print(f"shape: transformers {tuple(theirs.shape)}, merak {(n, vocab)}")
        return 1
    diff = (theirs - ours).abs().max().item()
    scale = ours.abs().max().item()
    rel = diff / max(scale, 1e-12)
    same_argmax = bool((theirs.argmax(-1) == ours.argmax(-1)).all())
    print(
        f"{cls.__name__}: {n} positions x {vocab} logits: max |transformers - merak| = {diff:.3e} "
        f"(largest logit {scale:.3f}, relative {rel:.3e}); same arg-max at every position: {same_argmax}"
    )
    ok = rel <= a.tolerance and same_argmax
    if a.expect_ids:
        expected = [int(t) for t in a.expect_ids.split(",")]
        new = len(expected) - n
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                attention_mask=torch.ones_like(ids),
            )[0].tolist()
        same = out == expected
        print(f"greedy continuation of {new} tokens, transformers == merak: {same}")
        if not same:
            print(f"  transformers: {out}\n  merak:        {expected}")
        ok = ok and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
