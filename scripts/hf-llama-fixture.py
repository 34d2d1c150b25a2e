#!/usr/bin/env python3
"""Fixtures for the Llama example's Hugging Face import and export (examples/llama/tests/hf.rs).

Builds small LlamaForCausalLM and MixtralForCausalLM models with random weights (nothing
pretrained), saves each with `save_pretrained` and writes what transformers computes for a
fixed batch of tokens next to it, in `expected.json`: the logits of every position (fp32) and a
greedy continuation with the gap between the two best logits at each step (and, for Mixtral,
the smallest gap between a token's second and third router probability, `router_margin`: how
far the routing is from a tie). The Rust tests read only these files (CI has no PyTorch):

- `gqa/`: grouped-query attention (4 heads, 2 kv heads), untied head, Llama-3 rope scaling,
  rope_theta 500000, one `model.safetensors` in bf16 (the reference logits are computed in
  fp32 from the bf16-rounded weights, so the file holds exactly what was computed with).
- `tied/`: one kv head, head tied to the token embedding, fp32, saved in several files with
  `model.safetensors.index.json`.
- `mixtral/`: a MixtralForCausalLM, 4 experts of width 32 with 2 per token, grouped-query
  attention (4 heads, 2 kv heads), rope_theta 1e6, a sliding window of 32 positions (longer
  than the sequences computed, so the attention is the full causal one), the router's
  auxiliary loss on (`output_router_logits`), one `model.safetensors` in bf16 with transformers'
  per-expert tensor names (`block_sparse_moe.experts.{e}.w1/w2/w3`, as `save_pretrained`
  writes them by default).

Usage (the venv with torch and transformers):

    python scripts/hf-llama-fixture.py [--out examples/llama/tests/fixtures] [--only NAME ...]
        Writes the fixtures (all, or those named; deterministic: seeded).
    python scripts/hf-llama-fixture.py --check DIR --expected FILE
        Loads the model at DIR (e.g. one exported by `write_hf_llama`, Llama or Mixtral) with
        transformers (AutoModelForCausalLM) and
        compares its logits and greedy continuation with FILE (an `expected.json`): the live
        check of an export.
"""

import argparse
import json
import math
import os
import sys

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

NEW_TOKENS = 8

VARIANTS = {
    "gqa": dict(
        config=dict(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            # wavelengths 6.3 (< 64 / 8: kept), 32 (between: smoothed) and 167+ (> 64: divided)
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=8.0,
                original_max_position_embeddings=64,
            ),
        ),
        dtype=torch.bfloat16,
        shard=None,
        seed=1,
    ),
    "tied": dict(
        config=dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        dtype=torch.float32,
        shard="24KB",
        seed=2,
    ),
    "mixtral": dict(
        arch="mixtral",
        config=dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            sliding_window=32,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            output_router_logits=True,
            router_aux_loss_coef=0.02,
        ),
        dtype=torch.bfloat16,
        shard=None,
        seed=3,
    ),
}

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
}


def tokens(vocab):
    """A fixed batch of 2 x 12 token ids."""
    a = [(7 * i + 3) % vocab for i in range(12)]
    b = [(11 * i * i + 5) % vocab for i in range(12)]
    return torch.tensor([a, b], dtype=torch.long)


def randomize(model, seed):
    """Weights that make O(1) logits with clear gaps: normal with std 1/sqrt(fan_in) for the
    projections, 1 for the embedding, and norm weights around 1 (all distinct, so that a
    misplaced tensor changes the logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                # The last dimension is the input one, also of Mixtral's stacked experts.
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def router_margin(out, top_k):
    """The smallest gap, over every layer and token, between a token's top_k-th and
    top_k + 1-th router probability (`out` of a Mixtral run with `output_router_logits`)."""
    margin = math.inf
    for layer in out.router_logits:
        probs = torch.softmax(layer.float(), dim=-1)
        top = torch.topk(probs, top_k + 1, dim=-1).values
        margin = min(margin, float((top[:, top_k - 1] - top[:, top_k]).min()))
    return margin


def run(model, ids):
    """fp32 logits of every position, and a greedy continuation of NEW_TOKENS tokens (no
    cache: each step runs the whole sequence) with the top-two gap of each step."""
    model.eval()
    moe = getattr(model.config, "num_local_experts", None) is not None
    extra = {"output_router_logits": True} if moe else {}
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, **extra)
        logits = out.logits.float()
        seq = ids.clone()
        generated, gaps = [], []
        for _ in range(NEW_TOKENS):
            last = model(input_ids=seq, use_cache=False).logits[:, -1].float()
            top = torch.topk(last, 2, dim=-1)
            nxt = top.indices[:, 0]
            generated.append(nxt.tolist())
            gaps.append((top.values[:, 0] - top.values[:, 1]).tolist())
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    result = {
        "input_ids": ids.tolist(),
        "logits_shape": list(logits.shape),
        "logits": [float(x) for x in logits.reshape(-1).tolist()],
        # [batch][step]
        "generated": [list(t) for t in zip(*generated)],
        "gaps": [list(t) for t in zip(*gaps)],
    }
    if moe:
        result["router_margin"] = router_margin(out, model.config.num_experts_per_tok)
    return result


def build(out, name, v):
    torch.manual_seed(v["seed"])
    config_class, model_class = ARCHS[v.get("arch", "llama")]
    cfg = config_class(**v["config"], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "eager"
    if v.get("arch") == "mixtral":
        # The experts one after another, as modeling_mixtral.py writes them.
        cfg._experts_implementation = "eager"
    model = model_class(cfg).float()
    randomize(model, v["seed"])
    # Round the weights (not the rotary frequency buffers, which `.to(dtype)` would round
    # too) to the dtype they are saved in, then compute in fp32 from those.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(v["dtype"]).float())
    ids = tokens(cfg.vocab_size)
    expected = run(model, ids)
    expected["about"] = (
        f"random weights (seed {v['seed']}); logits of transformers {transformers.__version__}, "
        f"torch {torch.__version__}, fp32 eager attention; see scripts/hf-llama-fixture.py"
    )
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    for f in os.listdir(folder):
        os.remove(os.path.join(folder, f))
    kwargs = {"max_shard_size": v["shard"]} if v["shard"] else {}
    model.to(v["dtype"]).save_pretrained(folder, safe_serialization=True, **kwargs)
    gen = os.path.join(folder, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump(expected, f)
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}
    print(name, sizes)


def check(folder, expected_path, tol):
    with open(expected_path) as f:
        expected = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    if getattr(model.config, "num_local_experts", None) is not None:
        model.config._experts_implementation = "eager"
    got = run(model, torch.tensor(expected["input_ids"]))
    diff = max(abs(a - b) for a, b in zip(got["logits"], expected["logits"]))
    print(f"{folder}: max |logit difference| {diff:.3e}")
    ok = diff <= tol
    for b, (g, w) in enumerate(zip(got["generated"], expected["generated"])):
        if g != w:
            print(f"sequence {b}: generated {g}, expected {w}")
            ok = False
    print("OK" if ok else "MISMATCH")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "..", "examples", "llama", "tests", "fixtures"))
    p.add_argument("--check", metavar="DIR")
    p.add_argument("--expected", metavar="FILE")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="write only these fixtures")
    a = p.parse_args()
    torch.use_deterministic_algorithms(True)
    if a.check:
        if not a.expected:
            p.error("--check needs --expected")
        sys.exit(0 if check(a.check, a.expected, a.tol) else 1)
    for name, v in VARIANTS.items():
        if a.only is None or name in a.only:
            build(a.out, name, v)


if __name__ == "__main__":
    main()
