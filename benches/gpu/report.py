"""Summarises benches/gpu/run.sh's runs as Markdown: tokens/s, MFU and peak GPU memory of merak
and PyTorch per model, and the two-rank loss differences.

MFU is the model's FLOPs per token without recomputation (Megatron-LM's count, Narayanan et al.
SC'21: 72 l h^2 (1 + s/(6h) + V/(12 l h)) per token of sequences of s tokens; the book's
docs/src/contributing/architecture.md, "FLOPs and MFU") times the tokens per second, over
the GPU's dense bf16 peak (--peak-tflops, else derived from the device's name: H100 SXM and H200
989, H100 NVL and H200 NVL 835, H100 PCIe 756 TFLOP/s; fp32 runs are measured against the bf16 peak too).
"""

import argparse
import json
import statistics
from pathlib import Path

SHAPES = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16)}
SEQ, VOCAB = 1024, 50257


def flops_per_token(layers: int, hidden: int) -> float:
    s, l, h, v = SEQ, layers, hidden, VOCAB
    return 72.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))


# Dense bf16 tensor-core peaks (NVIDIA's data sheets, without sparsity), by device name.
PEAKS = [("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0)]


def peak_of(name: str) -> float | None:
    return next((tflops for key, tflops in PEAKS if key in name), None)


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def median_tokens(rows: list[dict]) -> float | None:
    # The first two steps warm up (allocations, compilation).
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]
    return statistics.median(speeds) if speeds else None


def peak_sampled(path: Path) -> float | None:
    values = []
    if path.exists():
        for line in path.read_text().split():
            try:
                values.append(float(line))
            except ValueError:
                pass
    return max(values) if values else None


def reserved_mib(runs: list) -> list[tuple[str, float]]:
    # The allocators' reserved bytes, measured alike: merak's `device_reserved_bytes` (CubeCL's
    # pools, largest over the steps), PyTorch's and Megatron's `max_memory_reserved`.
    out = []
    for name, rows, _ in runs:
        merak = [r["device_reserved_bytes"] for r in rows if r.get("device_reserved_bytes")]
        summary = next((r for r in rows if r.get("summary")), {})
        if merak:
            out.append((name, max(merak) / 2**20))
        elif summary.get("peak_gpu_reserved_mib"):
            out.append((name, summary["peak_gpu_reserved_mib"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--peak-tflops", type=float, default=None)
    a = p.parse_args()
    gpu = (a.out / "gpu.txt").read_text().strip() if (a.out / "gpu.txt").exists() else "?"
    a.peak_tflops = a.peak_tflops or peak_of(gpu) or 989.0
    gpu = gpu.replace("\n", "; ")
    print(f"# GPU: {gpu}; peak {a.peak_tflops:.0f} TFLOP/s; sequence {SEQ}\n")
    print("| model | run | micro-batch | tokens/s | MFU | peak GPU MiB | first loss -> last |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    reserved = []
    for model, (layers, hidden, _) in SHAPES.items():
        fpt = flops_per_token(layers, hidden)
        mbs_file = a.out / f"merak-{model}.mbs"
        mbs = mbs_file.read_text().strip() if mbs_file.exists() else "-"
        runs = [("merak bf16", records(a.out / f"merak-{model}" / "metrics.jsonl"),
                 peak_sampled(a.out / f"merak-{model}.mem")),
                ("merak fp32", records(a.out / f"merak-fp32-{model}" / "metrics.jsonl"), None)]
        for mode, precision in [("eager", "fp32"), ("eager", "bf16"), ("compile", "bf16")]:
            rows = records(a.out / f"torch-{model}-{mode}-{precision}.jsonl")
            summary = next((r for r in rows if r.get("summary")), {})
            runs.append((f"torch {mode} {precision}", rows, summary.get("peak_gpu_mib")))
        rows = records(a.out / f"megatron-{model}.jsonl")
        summary = next((r for r in rows if r.get("summary")), {})
        runs.append(("megatron-core bf16", rows, summary.get("peak_gpu_mib")))
        speed = {name: median_tokens(rows) for name, rows, _ in runs}
        reserved += [f"| {model} | {name} | {mib:,.0f} |" for name, mib in reserved_mib(runs)]
        for other in ["torch eager bf16", "torch compile bf16", "megatron-core bf16"]:
            if speed["merak bf16"] and speed[other]:
                ratios.append(f"| {model} | {other} | {speed['merak bf16'] / speed[other]:.3f} |")
            else:
                ratios.append(f"| {model} | {other} | - |")
        for name, rows, mem in runs:
            tps = speed[name]
            losses = [r["loss"] for r in rows if "loss" in r]
            loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"
            if tps is None:
                print(f"| {model} | {name} | {mbs} | failed | - | - | - |")
                continue
            mfu = 100.0 * tps * fpt / (a.peak_tflops * 1e12)
            mem_text = f"{mem:.0f}" if mem else "-"
            print(f"| {model} | {name} | {mbs} | {tps:,.0f} | {mfu:.1f}% | {mem_text} | {loss} |")
    print("\n| model | merak bf16 against | tokens/s ratio |")
    print("| --- | --- | --- |")
    print("\n".join(ratios))
    if reserved:
        print("\n| model | run | peak allocator reserved MiB |")
        print("| --- | --- | --- |")
        print("\n".join(reserved))
    changes = sorted(d for d in a.out.glob("changes-*") if (d / "metrics.jsonl").exists())
    if changes:
        print("\n| changes run | tokens/s | host reads per step | first loss -> last |")
        print("| --- | --- | --- | --- |")
    for d in changes:
        rows = records(d / "metrics.jsonl")
        tps = median_tokens(rows)
        reads = sorted({r["host_reads"] for r in rows if "host_reads" in r})
        losses = [r["loss"] for r in rows if "loss" in r]
        loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"
        tps_text = f"{tps:,.0f}" if tps else "failed"
        reads_text = ", ".join(str(r) for r in reads) or "-"
        print(f"| {d.name} | {tps_text} | {reads_text} | {loss} |")
    kernel_losses(a.out)
    check = a.out / "nccl-check.log"
    lines = check.read_text().strip().splitlines() if check.exists() else ["not run"]
    print(f"\nNCCL self-check (one rank): {lines[-1] if lines else 'no output'}")
    shared = a.out / "nccl-shared.log"
    refused = shared.exists() and "one GPU per rank" in shared.read_text()
    print(f"Two ranks asking for NCCL on one GPU refused before training: {refused}")
    print("\n| tiny GPT, 5 steps | max relative loss difference to 1 rank |")
    print("| --- | --- |")
    one = [r["loss"] for r in records(a.out / "tiny-1" / "metrics.jsonl") if "loss" in r]
    for name in ["tp2", "pp2"]:
        other = [r["loss"] for r in records(a.out / f"tiny-{name}" / "metrics.jsonl") if "loss" in r]
        if not one or len(other) != len(one):
            print(f"| {name} | failed |")
            continue
        diff = max(abs(x - y) / abs(y) for x, y in zip(other, one))
        print(f"| {name} | {diff:.2e} |")


def kernel_losses(out: Path) -> None:
    """The kernels phase's tiny GPT on CUDA (each kernel alone, fp32, bf16, the attention's
    tile products) against the same 5 steps on the CPU: the largest relative loss difference,
    printed where the phase ran."""
    cpu = [r["loss"] for r in records(out / "kernels-tiny-cpu" / "metrics.jsonl") if "loss" in r]
    runs = sorted(d for d in out.glob("kernels-*") if d.is_dir() and d.name != "kernels-tiny-cpu")
    runs = [d for d in runs if not d.name.startswith("kernels-gpt2")]
    if not cpu or not runs:
        return
    print("\n| kernels run, tiny GPT | steps | max relative loss difference to the CPU |")
    print("| --- | --- | --- |")
    for d in runs:
        losses = [r["loss"] for r in records(d / "metrics.jsonl") if "loss" in r]
        if len(losses) != len(cpu):
            print(f"| {d.name} | {len(losses)} | failed |")
            continue
        diff = max(abs(x - y) / abs(y) for x, y in zip(losses, cpu))
        print(f"| {d.name} | {len(losses)} | {diff:.2e} |")


if __name__ == "__main__":
    main()
