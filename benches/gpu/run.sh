#!/usr/bin/env bash
# The GPU benchmark (issue 17), run on the GPU machine from the repository root, after
# `scripts/gpu-bundle.sh` built gpu-bundle/ here and it travelled with the tree:
#
#   bash benches/gpu/run.sh            # OUT=runs/gpu STEPS=12 PEAK_TFLOPS=989 (H100 SXM bf16)
#
# 1. GPT-2 small (124M) and medium (355M), sequence 1024, synthetic data, one GPU: merak bf16
#    at the largest micro-batch of 16, 8, 4, 2, 1 that runs, merak fp32 at that micro-batch,
#    and PyTorch eager fp32, eager bf16 (autocast) and torch.compile bf16, on the same model
#    and step (benches/pytorch/gpt_train.py), and Megatron-Core's GPT (plain-PyTorch layer
#    spec, its own bf16 recipe) at the same micro-batch (benches/gpu/megatron_gpt.py).
# 2. Two ranks on the one GPU over MPI: tp=2 and pp=2 against one rank, tiny GPT, 5 steps.
# Before them, `merak probe --nccl` on one rank (Burn's CUDA buffers lent to NCCL).
# benches/gpu/report.py prints tokens/s, MFU (DESIGN.md section 5's FLOPs over PEAK_TFLOPS)
# and peak GPU memory, and the 2-rank loss differences.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ ! -f gpu-bundle/env.sh ]; then
    echo "benches/gpu/run.sh: gpu-bundle/ is missing: run scripts/gpu-bundle.sh first" >&2
    exit 2
fi
# shellcheck disable=SC1091
source gpu-bundle/env.sh
out=${OUT:-runs/gpu}
steps=${STEPS:-12}
python=${PYTHON:-python3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

# NCCL on this GPU: one rank lends Burn's CUDA buffers to NCCL (the device all-reduce and
# all-gather against exact values); two ranks asking for NCCL on one GPU must be refused.
mpirun -np 1 merak probe --nccl >"$out/nccl-check.log" 2>&1 || echo "merak probe --nccl failed"
mpirun -np 2 --oversubscribe merak train --config configs/gpt-tiny.toml --tp 2 \
    --set train.device=cuda --set train.comm=nccl --set train.steps=1 --out "$out/nccl-shared" \
    >"$out/nccl-shared.log" 2>&1 && echo "two ranks on one GPU with NCCL were not refused"

shape() {
    case $1 in
        gpt2) echo "12 768 12" ;;
        gpt2-medium) echo "24 1024 16" ;;
    esac
}

# Peak GPU memory of a run, sampled by nvidia-smi every 200 ms into $1.
watch_memory() {
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$1" &
    echo $!
}

for model in gpt2 gpt2-medium; do
    read -r layers hidden heads <<<"$(shape $model)"
    mbs=""
    for b in 16 8 4 2 1; do
        dir="$out/merak-$model"
        rm -rf "$dir"
        watcher=$(watch_memory "$out/merak-$model.mem")
        merak train --set model.preset=$model --set model.seq_len=1024 --set train.precision=bf16 \
            --set data.kind=synthetic --set train.device=cuda --set train.micro_batch=$b \
            --set train.global_batch=$b --set train.steps="$steps" --set train.warmup_steps=2 \
            --set checkpoint.at_end=false --out "$dir" >"$out/merak-$model.log" 2>&1
        status=$?
        kill "$watcher" 2>/dev/null
        if [ $status -eq 0 ]; then
            mbs=$b
            echo "$b" >"$out/merak-$model.mbs"
            break
        fi
        echo "merak $model micro-batch $b: exit $status (see $out/merak-$model.log)"
    done
    mbs=${mbs:-1}
    merak train --set model.preset=$model --set model.seq_len=1024 --set train.precision=fp32 \
        --set data.kind=synthetic --set train.device=cuda --set train.micro_batch="$mbs" \
        --set train.global_batch="$mbs" --set train.steps="$steps" --set train.warmup_steps=2 \
        --set checkpoint.at_end=false --out "$out/merak-fp32-$model" >"$out/merak-fp32-$model.log" 2>&1 ||
        echo "merak fp32 $model failed (see its log)"
    for variant in "eager fp32" "eager bf16" "compile bf16"; do
        read -r mode precision <<<"$variant"
        flags=(--device cuda --precision "$precision")
        [ "$mode" = compile ] && flags+=(--compile)
        "$python" benches/pytorch/gpt_train.py "${flags[@]}" --vocab 50257 --layers "$layers" \
            --hidden "$hidden" --heads "$heads" --seq 1024 --batch "$mbs" --steps "$steps" \
            --warmup 2 --threads 8 --out "$out/torch-$model-$mode-$precision.jsonl" \
            >"$out/torch-$model-$mode-$precision.log" 2>&1 ||
            echo "torch $model $mode $precision failed (see its log)"
    done
    "$python" benches/gpu/megatron_gpt.py --vocab 50257 --layers "$layers" --hidden "$hidden" \
        --heads "$heads" --seq 1024 --batch "$mbs" --steps "$steps" --warmup 2 \
        --out "$out/megatron-$model.jsonl" >"$out/megatron-$model.log" 2>&1 ||
        echo "megatron-core $model failed (see its log)"
done

# Two ranks on one GPU (MPI carries the messages): tp=2 and pp=2 against one rank.
tiny=(--config configs/gpt-tiny.toml --set train.device=cuda --set train.steps=5
    --set train.micro_batch=2 --set checkpoint.at_end=false)
merak train "${tiny[@]}" --out "$out/tiny-1" >"$out/tiny-1.log" 2>&1 || echo "tiny 1 rank failed"
mpirun -np 2 --oversubscribe merak train "${tiny[@]}" --tp 2 --out "$out/tiny-tp2" \
    >"$out/tiny-tp2.log" 2>&1 || echo "tiny tp=2 failed"
mpirun -np 2 --oversubscribe merak train "${tiny[@]}" --pp 2 --out "$out/tiny-pp2" \
    >"$out/tiny-pp2.log" 2>&1 || echo "tiny pp=2 failed"

"$python" benches/gpu/report.py "$out" --peak-tflops "${PEAK_TFLOPS:-989}" | tee "$out/report.md"
