"""The PyTorch side of `bench-vs-pytorch`: merak's GPT and training step, written in PyTorch.

The model is `models/gpt` (pre-LayerNorm GPT-2: token and position embeddings, blocks of
LayerNorm -> causal self-attention with a fused Q/K/V projection -> residual, LayerNorm -> MLP
with exact GELU -> residual, final LayerNorm, head tied to the token embedding, mean
cross-entropy). The weights are drawn by merak's own initializer (`InitRng`: SplitMix64 streams
keyed by seed and parameter name, Box-Muller), re-implemented here with numpy, so both sides
start from the same bits; the data is merak's synthetic source (`SyntheticData`), so both see
the same tokens and the first losses agree to float rounding. The step is merak's: AdamW in
two groups (matrices and embeddings decay, vectors do not), gradient clipping to a global norm,
linear warm-up then cosine decay, fp32, one compute thread.

One process, or data parallel under `mpirun -np N` (DistributedDataParallel over gloo, or with
`--fsdp 2|3` PyTorch's `fully_shard` over gloo, each block and the root a unit; each rank its
slice of the global batch, as `merak train` splits it). Gloo has no native reduce-scatter: torch
runs it as an all-reduce underneath, so an FSDP run measures gloo as much as FSDP.

Writes one JSON object per step to `--out` (`step`, `loss`, `lr`, `grad_norm`, `step_time_s`,
`tokens_per_s`, `minor_faults`) and a summary line with the peak resident memory (the largest
over ranks).
"""

import argparse
import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

MASK64 = (1 << 64) - 1
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def fnv1a(name: str) -> int:
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & MASK64
    return h


def rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK64


def mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def splitmix_seq(state: int, n: int) -> np.ndarray:
    """The first `n` outputs of SplitMix64 from `state` (each call adds GOLDEN first)."""
    with np.errstate(over="ignore"):
        k = np.arange(1, n + 1, dtype=np.uint64)
        return mix(np.uint64(state) + k * GOLDEN)


class InitRng:
    """merak_burn::tensor_parallel::InitRng."""

    def __init__(self, seed: int):
        self.seed = seed & MASK64

    def stream(self, name: str) -> int:
        s = self.seed ^ rotl(fnv1a(name), 17)
        with np.errstate(over="ignore"):
            return int(splitmix_seq(s, 1)[0])

    def normal(self, name: str, n: int, std: float) -> np.ndarray:
        pairs = (n + 1) // 2
        with np.errstate(over="ignore"):
            r = splitmix_seq(self.stream(name), 2 * pairs)
        u1 = ((r[0::2] >> np.uint64(11)).astype(np.float64) + 1.0) / float(1 << 53)
        u2 = (r[1::2] >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        rad = np.sqrt(-2.0 * np.log(u1))
        t = 2.0 * math.pi * u2
        out = np.empty(2 * pairs, dtype=np.float32)
        out[0::2] = (rad * np.cos(t)).astype(np.float32) * np.float32(std)
        out[1::2] = (rad * np.sin(t)).astype(np.float32) * np.float32(std)
        return out[:n]

    def integers(self, name: str, n: int, bound: int) -> np.ndarray:
        with np.errstate(over="ignore"):
            return splitmix_seq(self.stream(name), n) % np.uint64(max(bound, 1))


def synthetic_batch(seed: int, vocab: int, step: int, first: int, count: int, seq: int):
    """merak's SyntheticData::batch: arithmetic progressions modulo the vocabulary."""
    rng = InitRng(seed ^ 0x5EEDDA7A)
    rows = []
    for i in range(first, first + count):
        r = rng.integers(f"synthetic/{step}/{i}", 2, vocab)
        start, stride = int(r[0]), 1 + int(r[1]) % 7
        rows.append([(start + t * stride) % vocab for t in range(seq + 1)])
    a = torch.tensor(rows, dtype=torch.long)
    return a[:, :seq].contiguous(), a[:, 1:].contiguous()


class Block(torch.nn.Module):
    def __init__(self, h: int, heads: int, eps: float, sdpa: bool):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln_1 = torch.nn.LayerNorm(h, eps=eps)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.attn_proj = torch.nn.Linear(h, h)
        self.ln_2 = torch.nn.LayerNorm(h, eps=eps)
        self.fc = torch.nn.Linear(h, 4 * h)
        self.mlp_proj = torch.nn.Linear(4 * h, h)

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.attn_proj(y.transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))


class Gpt(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        h = a.hidden
        self.wte = torch.nn.Embedding(a.vocab, h)
        self.wpe = torch.nn.Embedding(a.seq, h)
        self.blocks = torch.nn.ModuleList(
            Block(h, a.heads, a.eps, a.attention == "sdpa") for _ in range(a.layers)
        )
        self.ln_f = torch.nn.LayerNorm(h, eps=a.eps)
        self.init_like_merak(a)

    @torch.no_grad()
    def init_like_merak(self, a):
        """models/gpt Gpt::new_units: N(0, std^2), residual projections std / sqrt(2 l)."""
        rng, h, std = InitRng(a.seed), a.hidden, a.init_std
        proj_std = np.float32(std) / np.float32(math.sqrt(2.0 * a.layers))

        def draw(name, rows, cols, s):
            return torch.from_numpy(rng.normal(name, rows * cols, s).reshape(rows, cols))

        def linear(lin, name, rows, cols, s):
            # merak stores linear weights as [in, out]; torch as [out, in].
            lin.weight.copy_(draw(name, rows, cols, s).t())

        self.wte.weight.copy_(draw("wte", a.vocab, h, std))
        self.wpe.weight.copy_(draw("wpe", a.seq, h, std))
        for i, blk in enumerate(self.blocks):
            linear(blk.qkv, f"h.{i}.attn.c_attn.weight", h, 3 * h, std)
            linear(blk.attn_proj, f"h.{i}.attn.c_proj.weight", h, h, proj_std)
            linear(blk.fc, f"h.{i}.mlp.c_fc.weight", h, 4 * h, std)
            linear(blk.mlp_proj, f"h.{i}.mlp.c_proj.weight", 4 * h, h, proj_std)
            for lin in (blk.qkv, blk.attn_proj, blk.fc, blk.mlp_proj):
                lin.bias.zero_()

    def forward(self, ids, targets):
        s = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(s, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def lr_at(a, step: int) -> float:
    """merak_burn::train::LrSchedule::at."""
    if a.warmup > 0 and step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    span = max(a.steps - a.warmup, 1)
    t = min((step - min(a.warmup, step)) / span, 1.0)
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1.0 + math.cos(math.pi * t))


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def start_profiler(device: str):
    """Starts torch.profiler on the CPU and, on a GPU, on CUDA too."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=acts)
    profiler.__enter__()
    return profiler


def write_profile(profiler, path: str, device: str):
    """Stops the profiler and writes its operators and kernels, by total device time."""
    profiler.__exit__(None, None, None)
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    with open(path, "w") as f:
        f.write(profiler.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("vocab", 512), ("layers", 2), ("heads", 4), ("hidden", 64),
                          ("seq", 32), ("batch", 8), ("steps", 30), ("warmup", 10),
                          ("seed", 1234), ("threads", 1)]:
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in [("lr", 3e-3), ("min-lr", 3e-4), ("weight-decay", 0.01),
                          ("grad-clip", 1.0), ("beta1", 0.9), ("beta2", 0.95), ("adam-eps", 1e-8),
                          ("eps", 1e-5), ("init-std", 0.02)]:
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--attention", choices=["sdpa", "math"], default="sdpa",
                   help="sdpa: F.scaled_dot_product_attention (what nanoGPT uses); math: "
                        "matmul, mask, softmax, matmul")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="float64: a reference trajectory (the same initial values, in double)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: autocast to bfloat16 (fp32 weights, gradients and AdamW)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--fsdp", type=int, choices=[0, 2, 3], default=0,
                   help="with several ranks: 0 DistributedDataParallel; 2 fully_shard (FSDP2) "
                        "keeping the gathered parameters from forward to backward "
                        "(reshard_after_forward=False, ZeRO-2-like); 3 fully_shard freeing "
                        "them after each block's forward (ZeRO-3)")
    p.add_argument("--out", required=True, help="JSON lines, one per step, then a summary")
    p.add_argument("--profile", metavar="PATH",
                   help="profile the last two steps with torch.profiler and write its table of "
                        "kernels by total device time to PATH")
    a = p.parse_args()
    if a.precision == "bf16" and a.device != "cuda":
        raise SystemExit("--precision bf16 needs --device cuda")

    torch.set_num_threads(a.threads)
    torch.set_default_dtype(getattr(torch, a.dtype))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    if a.batch % world:
        raise SystemExit(f"--batch {a.batch} is not divisible by {world} ranks")
    local = a.batch // world

    dev = torch.device(a.device)
    model = Gpt(a).to(dev)
    step_model = torch.compile(model) if a.compile else model
    if world > 1 and a.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(a.device, (world,))
        reshard = a.fsdp == 3
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    elif world > 1:
        step_model = torch.nn.parallel.DistributedDataParallel(step_model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(a.beta1, a.beta2), eps=a.adam_eps, foreach=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()


    out = open(a.out, "w") if rank == 0 else None
    tokens = a.batch * a.seq
    t_all = time.perf_counter()
    profiler = None
    for step in range(a.steps):
        if a.profile and step == max(a.steps - 2, 0):
            profiler = start_profiler(a.device)
        t0 = time.perf_counter()
        f0 = minor_faults()
        ids, targets = synthetic_batch(a.seed, a.vocab, step, rank * local, local, a.seq)
        ids, targets = ids.to(dev), targets.to(dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(a, step)
        with autocast:
            loss = step_model(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        opt.step()
        value = loss.detach()
        if world > 1:
            torch.distributed.all_reduce(value)
            value /= world
        sync()
        dt = time.perf_counter() - t0
        if out:
            out.write(json.dumps({
                "step": step + 1, "loss": value.item(), "lr": lr_at(a, step),
                "grad_norm": norm.item(), "step_time_s": dt, "tokens_per_s": tokens / dt,
                "minor_faults": minor_faults() - f0}) + "\n")
    if profiler is not None:
        write_profile(profiler, a.profile, a.device)
    peak = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024)
    if world > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if out:
        gpu = torch.cuda.max_memory_allocated() / 2**20 if a.device == "cuda" else 0.0
        out.write(json.dumps({"summary": True, "peak_rss_mib": peak.item(),
                              "peak_gpu_mib": gpu, "device": a.device,
                              "precision": a.precision, "compile": a.compile,
                              "wall_s": time.perf_counter() - t_all,
                              "torch": torch.__version__}) + "\n")
        out.close()
    if world > 1:
        # Leave without tearing gloo down: its destructor aborts this torch build at exit
        # ("terminate called without an active exception") after the work is done.
        torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
