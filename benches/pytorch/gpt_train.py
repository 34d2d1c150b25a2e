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

With `--moe-experts E` every block's MLP is merak's mixture of experts (`merak_burn::moe`,
dropless): an f32 router, softmax scores, top-k (ties to the lower expert), renormalized gates,
GELU or SwiGLU experts and optional shared experts drawn from merak's streams
(`h.{i}.moe.router`, `h.{i}.moe.experts.{e}.w_in`/`.w_out`, `h.{i}.moe.shared.*`), each
expert computed in a Python loop over the tokens routed to it, as an eager implementation
does; the Switch load-balancing and z auxiliary losses of each rank's micro-batch are added to
its loss (DDP averages them over the ranks, as merak weights each micro-batch's by its share of
the step), and logged as `aux_loss` (the logged `loss` is the cross-entropy).

One process, or data parallel under `mpirun -np N` (DistributedDataParallel over gloo, or with
`--fsdp 2|3` PyTorch's `fully_shard` over gloo, each block and the root a unit; each rank its
slice of the global batch, as `merak train` splits it). Gloo has no native reduce-scatter: torch
runs it as an all-reduce underneath, so an FSDP run measures gloo as much as FSDP.

Writes one JSON object per step to `--out` (`step`, `loss`, `lr`, `grad_norm`, `step_time_s`,
`tokens_per_s`, `minor_faults`, and `aux_loss` with MoE) and a summary line with the peak
resident memory (the largest over ranks) and the parameters of one rank (`param_mib`).
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


class Expert(torch.nn.Module):
    """merak_burn::moe::Expert: GELU `fc2(gelu(fc1 x + b1)) + b2` or SwiGLU
    `down(silu(gate x) * up x)` (no biases; the input projection's outputs are the gate's, then
    the up projection's)."""

    def __init__(self, h: int, width: int, activation: str):
        super().__init__()
        self.swiglu = activation == "swiglu"
        cols = 2 * width if self.swiglu else width
        self.w_in = torch.nn.Linear(h, cols, bias=not self.swiglu)
        self.w_out = torch.nn.Linear(width, h, bias=not self.swiglu)

    def init_like_merak(self, draw, name, h, std, proj_std):
        self.w_in.weight.copy_(draw(f"{name}.w_in", h, self.w_in.out_features, std).t())
        self.w_out.weight.copy_(draw(f"{name}.w_out", self.w_out.in_features, h, proj_std).t())
        for lin in (self.w_in, self.w_out):
            if lin.bias is not None:
                lin.bias.zero_()

    def forward(self, x):
        z = self.w_in(x)
        if self.swiglu:
            gate, up = z.chunk(2, dim=1)
            return self.w_out(F.silu(gate) * up)
        return self.w_out(F.gelu(z))


class Moe(torch.nn.Module):
    """merak_burn::moe::MoeLayer, dropless: an f32 router `x @ W` `[hidden, E]`, softmax scores,
    each token's top k (ties to the lower expert), gates renormalized to sum 1; each expert in a
    Python loop over the tokens routed to it (index_select, its two matmuls, index_add_); shared
    experts (one network of their summed width) on every token. `self.aux` holds the layer's
    Switch and z auxiliary losses of the last forward pass over its tokens."""

    def __init__(self, h: int, a):
        super().__init__()
        self.experts_n, self.k = a.moe_experts, a.moe_top_k
        self.aux_w, self.z_w = a.moe_aux_loss, a.moe_z_loss
        self.renormalize = not a.moe_no_renormalize
        self.router = torch.nn.Parameter(torch.empty(h, a.moe_experts))
        self.experts = torch.nn.ModuleList(
            Expert(h, a.moe_expert_hidden, a.moe_activation) for _ in range(a.moe_experts))
        self.shared = (Expert(h, a.moe_shared * a.moe_expert_hidden, a.moe_activation)
                       if a.moe_shared else None)
        self.aux = None

    def forward(self, x):
        b, s, h = x.shape
        xf = x.reshape(b * s, h)
        logits = xf.float() @ self.router
        scores = logits.softmax(dim=1)
        # Stable descending sort: equal scores keep the lower expert first, as merak's top_k.
        choice = torch.sort(scores.detach(), dim=1, descending=True, stable=True).indices[:, :self.k]
        gates = scores.gather(1, choice)
        if self.renormalize:
            gates = gates / gates.sum(dim=1, keepdim=True)
        flat, gflat = choice.reshape(-1), gates.reshape(-1, 1).to(x.dtype)
        out = torch.zeros_like(xf)
        for e, expert in enumerate(self.experts):
            slots = (flat == e).nonzero().squeeze(1)
            tokens = slots // self.k
            y = expert(xf.index_select(0, tokens)) * gflat.index_select(0, slots)
            out.index_add_(0, tokens, y)
        if self.shared is not None:
            out = out + self.shared(xf)
        self.aux = self.aux_loss(logits, scores, flat)
        return out.reshape(b, s, h)

    def aux_loss(self, logits, scores, flat):
        t, e = scores.shape
        aux = scores.new_zeros(())
        if self.aux_w > 0:
            f = torch.bincount(flat, minlength=e).to(scores.dtype) / (t * self.k)
            aux = aux + self.aux_w * e * (scores.mean(dim=0) * f).sum()
        if self.z_w > 0:
            aux = aux + self.z_w * torch.logsumexp(logits, dim=1).pow(2).mean()
        return aux


class Block(torch.nn.Module):
    def __init__(self, h: int, heads: int, a):
        super().__init__()
        self.heads, self.sdpa = heads, a.attention == "sdpa"
        self.ln_1 = torch.nn.LayerNorm(h, eps=a.eps)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.attn_proj = torch.nn.Linear(h, h)
        self.ln_2 = torch.nn.LayerNorm(h, eps=a.eps)
        self.moe = Moe(h, a) if a.moe_experts else None
        if self.moe is None:
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
        if self.moe is not None:
            return x + self.moe(self.ln_2(x))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))


class Gpt(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        h = a.hidden
        self.wte = torch.nn.Embedding(a.vocab, h)
        self.wpe = torch.nn.Embedding(a.seq, h)
        self.blocks = torch.nn.ModuleList(
            Block(h, a.heads, a) for _ in range(a.layers)
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
            for lin in (blk.qkv, blk.attn_proj):
                lin.bias.zero_()
            if blk.moe is None:
                linear(blk.fc, f"h.{i}.mlp.c_fc.weight", h, 4 * h, std)
                linear(blk.mlp_proj, f"h.{i}.mlp.c_proj.weight", 4 * h, h, proj_std)
                blk.fc.bias.zero_()
                blk.mlp_proj.bias.zero_()
                continue
            moe = blk.moe
            moe.router.copy_(draw(f"h.{i}.moe.router", h, moe.experts_n, std))
            for e, expert in enumerate(moe.experts):
                expert.init_like_merak(draw, f"h.{i}.moe.experts.{e}", h, std, proj_std)
            if moe.shared is not None:
                moe.shared.init_like_merak(draw, f"h.{i}.moe.shared", h, std, proj_std)

    def forward(self, ids, targets):
        s = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(s, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def aux_loss(self):
        """The MoE layers' auxiliary losses of the last forward pass, summed (0 without)."""
        terms = [blk.moe.aux for blk in self.blocks if blk.moe is not None]
        return sum(terms) if terms else None


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
    moe = p.add_argument_group("mixture of experts (merak's model.moe; off without --moe-experts)")
    moe.add_argument("--moe-experts", type=int, default=0,
                     help="routed experts per block, in place of every block's MLP")
    moe.add_argument("--moe-top-k", type=int, default=2)
    moe.add_argument("--moe-expert-hidden", type=int, default=0,
                     help="one expert's hidden width (default 4 x hidden)")
    moe.add_argument("--moe-shared", type=int, default=0, help="shared experts")
    moe.add_argument("--moe-activation", choices=["gelu", "swiglu"], default="gelu")
    moe.add_argument("--moe-aux-loss", type=float, default=0.01,
                     help="weight of the Switch load-balancing loss")
    moe.add_argument("--moe-z-loss", type=float, default=0.0, help="weight of the router z-loss")
    moe.add_argument("--moe-no-renormalize", action="store_true",
                     help="weight the experts by their softmax scores, not renormalized")
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
    if a.moe_experts and not a.moe_expert_hidden:
        a.moe_expert_hidden = 4 * a.hidden
    if a.moe_experts and not 0 < a.moe_top_k <= a.moe_experts:
        raise SystemExit(f"--moe-top-k {a.moe_top_k} must be in 1..={a.moe_experts}")

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
        # The MoE layers' auxiliary losses of this rank's micro-batch (its routing group): DDP
        # averages the gradients over the ranks, as merak weights each micro-batch's by
        # micro_batch / global_batch.
        aux = model.aux_loss()
        opt.zero_grad(set_to_none=True)
        (loss if aux is None else loss + aux).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        opt.step()
        value = torch.stack([loss.detach(), loss.new_zeros(()) if aux is None else aux.detach()])
        if world > 1:
            torch.distributed.all_reduce(value)
            value /= world
        sync()
        dt = time.perf_counter() - t0
        if out:
            record = {
                "step": step + 1, "loss": value[0].item(), "lr": lr_at(a, step),
                "grad_norm": norm.item(), "step_time_s": dt, "tokens_per_s": tokens / dt,
                "minor_faults": minor_faults() - f0}
            if aux is not None:
                record["aux_loss"] = value[1].item()
            out.write(json.dumps(record) + "\n")
    if profiler is not None:
        write_profile(profiler, a.profile, a.device)
    peak = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024)
    if world > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if out:
        gpu = torch.cuda.max_memory_allocated() / 2**20 if a.device == "cuda" else 0.0
        reserved = torch.cuda.max_memory_reserved() / 2**20 if a.device == "cuda" else 0.0
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out.write(json.dumps({"summary": True, "peak_rss_mib": peak.item(),
                              "param_mib": params / 2**20,
                              "peak_gpu_mib": gpu, "peak_gpu_reserved_mib": reserved,
                              "device": a.device,
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
