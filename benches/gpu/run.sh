#!/usr/bin/env bash
# The GPU benchmark, run on the GPU machine from the repository root, after
# `scripts/gpu-bundle.sh` built gpu-bundle/ here and it travelled with the tree:
#
#   bash benches/gpu/run.sh [PHASE...]     # default: smoke small ranks medium report
#
# GPU time is scarce and one command there is limited to minutes, so the benchmark runs in
# phases; each writes its results into RESULTS as it goes, and every run has its own time limit.
#   smoke   about a minute: the GPU and the driver, the bundle's libraries (NVRTC, NCCL), a
#           3-step tiny GPT on CUDA, `merak probe --nccl`, torch.compile on a small function,
#           and the Megatron-Core import. Exits 1 when merak cannot train on the GPU, so a
#           broken bundle costs a minute, not the whole budget.
#   small   GPT-2 small (124M), sequence 1024, synthetic data, one GPU: merak bf16 at the
#           largest micro-batch of 16, 8, 4, 2, 1 that runs, merak fp32 at that micro-batch,
#           PyTorch eager fp32, eager bf16 (autocast) and torch.compile bf16 on the same model
#           and step (benches/pytorch/gpt_train.py), and Megatron-Core's GPT (plain-PyTorch
#           layer spec, its own bf16 recipe; benches/gpu/megatron_gpt.py) at the same micro-batch.
#   medium  the same for GPT-2 medium (355M).
#   ranks   two ranks on the one GPU over MPI: tp=2 and pp=2 against one rank, tiny GPT, 5
#           steps (correctness only: two ranks time-slice one GPU); and two ranks asking for
#           NCCL on one GPU must be refused.
#   features not in the default list: the MoE GPT (ep = 1 fp32 and bf16, ep 2, ep 2 x tp 2 with
#           SP), sequence and context parallelism over MPI on the one GPU against one rank, and
#           `merak probe --nccl` (its grouped send/receive is expert parallelism's exchange).
#   profile not in the default list: GPT-2 small, merak bf16, micro-batch 16: 8 steps unprofiled
#           (the GPU's busy share from nvidia-smi, CPU against wall seconds), then 4 steps
#           with CubeCL's profiling log (every launch timed, so slower steps), summarised by
#           benches/gpu/kernel_profile.py into RESULTS/kernel-profile.md; and PyTorch eager
#           bf16's last two of 6 steps under torch.profiler (RESULTS/torch-profile.txt).
#   kernels not in the default list: merak's CubeCL kernels on CUDA: the tiny GPT with one fused
#           kernel at a time (MERAK_COMPOSED_KERNELS names the others), then all of them, on the
#           CPU and on CUDA fp32 and bf16, bf16 with the tiled attention (MERAK_ATTENTION_PRODUCT
#           cmma and scalar) (5 steps; the report compares each with the CPU), and GPT-2 small
#           bf16 at micro-batch 16 fused, composed and in PyTorch eager bf16 (8 steps, 2 warm-up).
#           First, where the bundle has them (KERNEL_TESTS=1 scripts/gpu-bundle.sh), the kernels'
#           unit tests on CUDA against the CPU's (RESULTS/kernel-tests.log).
#           KERNELS_ONLY (default: every kernel) lists the kernels tried one at a time;
#           KERNELS_TORCH=0 leaves out PyTorch.
#   changes not in the default list: GPT-2 small and medium, bf16, micro-batch 16: the linear
#           layers' products on the kernel table's choice (the default), on CubeCL's default
#           kernel (MERAK_COMPOSED_KERNELS=matmul) and on cuBLASLt (MERAK_CUBLASLT=1); the
#           attention on the tiled kernel's tensor cores (MERAK_ATTENTION_PRODUCT=cmma) and its
#           scalar form (=scalar) instead of Burn's attention (the default); both levers on.
#   torch-small  not in the default list: PyTorch eager bf16 on GPT-2 small, micro-batch 16.
#   tune    not in the default list: CubeCL's autotuner once (build with FEATURES=cuda-autotune,
#           its binary as gpu-bundle/bin/merak-autotune.gz), its cache under RESULTS/autotune,
#           then the tuned step with the cache warm.
#   report  benches/gpu/report.py: tokens/s, MFU, peak GPU memory, the 2-rank loss differences.
#
# DRY_RUN=1 runs the phases here, on the CPU, before any GPU minute is spent: every `merak train`
# on the tiny GPT for 3 steps with its keys and flags otherwise as on the GPU (so a wrong key or
# flag fails here), each Python script compiled rather than run (no PyTorch here), nvidia-smi
# answered by a stub; the merak of gpu-bundle/ (its CUDA build runs on the CPU too), or of
# DRY_RUN_BIN or target/release where there is none. The timings, logs and report come out as
# on the GPU, with CPU figures; `merak probe --nccl` fails (no GPU).
#
# Environment: RESULTS (the results folder, default runs/gpu), STEPS (default 8; the first two are warm-up),
# RUN_LIMIT_S (each run's time limit, default 150), ARCHIVE (if set, a .tar.gz of RESULTS rewritten
# after every run, so a killed command still brings back what finished), PEAK_TFLOPS (default:
# from the device's name, see report.py), CHANGES_MODELS (the models of `changes`, default
# "gpt2 gpt2-medium"; "gpt2" alone halves the phase for a short device session).
set -uo pipefail
# shellcheck source=benches/gpu/bundle.sh
source "$(dirname "$0")/bundle.sh"
out=${RESULTS:-runs/gpu}
steps=${STEPS:-8}
limit=${RUN_LIMIT_S:-150}
python=${PYTHON:-python3}
mkdir -p "$out"
# CubeCL compiles every kernel with NVRTC on its first use; its PTX cache (cubecl.toml, under
# the repository's target/, safe across processes) lets each later run load them instead.
# Written only where the repository has no cubecl.toml of its own, and removed at the end.
own_config=""
cache_config='[compilation]\ncache = "target"\n'
if [ ! -e cubecl.toml ] && [ "${DRY_RUN:-0}" != 1 ]; then
    printf "$cache_config" >cubecl.toml
    own_config=1
    trap 'rm -f cubecl.toml' EXIT
fi

# Saves RESULTS into ARCHIVE (when set).
save() {
    if [ -n "${ARCHIVE:-}" ]; then
        tar czf "$ARCHIVE.partial" -C "$out" . 2>/dev/null && mv "$ARCHIVE.partial" "$ARCHIVE"
    fi
}

# In a dry run (DRY_RUN=1): what `timed` runs instead of CMD, in `cmd`: a `merak train` with the
# tiny overrides after its own flags, a Python script compiled, anything else as it is.
dry_train=(--set train.device=cpu --set model.preset=tiny --set model.seq_len=32
    --set train.micro_batch=1 --set train.global_batch=2 --set train.steps=3
    --set train.warmup_steps=1)
dry_command() {
    local args=("$@") i
    cmd=("$@")
    for i in "${!args[@]}"; do
        if [ "${args[$i]}" = merak ] && [ "${args[$((i + 1))]:-}" = train ]; then
            cmd=("$@" "${dry_train[@]}")
            return
        fi
        case ${args[$i]} in
            # Compiled in memory: py_compile would write __pycache__ into the repository.
            *.py) cmd=("$python" -c 'import sys; compile(open(sys.argv[1]).read(), sys.argv[1], "exec")' "${args[$i]}") && return ;;
        esac
    done
}
if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "dry run: the phases on this machine's CPU, tiny GPT, Python scripts compiled only"
    nvidia-smi() { echo "dry run: no GPU"; }
fi

# `timed NAME CMD...`: runs CMD under the time limit, its output in RESULTS/NAME.log, and prints
# one line with its exit status and seconds.
timed() {
    local name=$1 start status cmd=()
    shift
    cmd=("$@")
    [ "${DRY_RUN:-0}" = 1 ] && dry_command "$@"
    start=$(date +%s%N)
    timeout --kill-after=10 "$limit" "${cmd[@]}" >"$out/$name.log" 2>&1
    status=$?
    printf '%-28s exit %3d  %6d ms\n' "$name" "$status" $((($(date +%s%N) - start) / 1000000)) |
        tee -a "$out/timings.txt"
    save
    return $status
}

# Peak GPU memory of a run, sampled by nvidia-smi every 200 ms into $1.
watch_memory() {
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$1" &
    echo $!
}

smoke() {
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/CUDA \1/p'
    } | tee "$out/gpu.txt"
    {
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
        ls -l gpu-bundle/links
        for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d" 2>/dev/null | grep -E 'nvrtc|nccl|cudart' | sed "s|^|$d/|"; done
        "$python" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
    } >"$out/env.txt" 2>&1
    "$python" - >"$out/compile-smoke.log" 2>&1 <<'EOF' &
import torch
f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x))
print("torch.compile:", float(f(torch.ones(64, 64, device="cuda")).sum()))
import megatron.core
print("megatron.core", getattr(megatron.core, "__version__", "?"))
EOF
    local pycheck=$!
    local ok=0
    timed smoke-tiny merak train --config configs/gpt-tiny.toml --set train.device=cuda \
        --set train.steps=3 --set checkpoint.at_end=false --out "$out/smoke-tiny" || ok=1
    timed smoke-tiny-bf16 merak train --config configs/gpt-tiny.toml --set train.device=cuda \
        --set train.precision=bf16 --set train.steps=3 --set checkpoint.at_end=false \
        --out "$out/smoke-tiny-bf16" || ok=1
    timed nccl-check mpirun -np 1 merak probe --nccl
    wait "$pycheck"
    cat "$out/compile-smoke.log"
    save
    return $ok
}

shape() {
    case $1 in
        gpt2) echo "12 768 12" ;;
        gpt2-medium) echo "24 1024 16" ;;
    esac
}

# merak, PyTorch and Megatron-Core on one GPT-2 shape ($1: gpt2 or gpt2-medium).
compare() {
    local model=$1 layers hidden heads mbs="" b watcher status variant mode precision
    read -r layers hidden heads <<<"$(shape "$model")"
    local common=(--set model.preset="$model" --set model.seq_len=1024 --set data.kind=synthetic
        --set train.device=cuda --set train.steps="$steps" --set train.warmup_steps=2
        --set checkpoint.at_end=false)
    for b in 16 8 4 2 1; do
        rm -rf "$out/merak-$model"
        watcher=$(watch_memory "$out/merak-$model.mem")
        timed "merak-$model" merak train "${common[@]}" --set train.precision=bf16 \
            --set train.micro_batch=$b --set train.global_batch=$b --out "$out/merak-$model"
        status=$?
        kill "$watcher" 2>/dev/null
        if [ $status -eq 0 ]; then
            mbs=$b
            echo "$b" >"$out/merak-$model.mbs"
            break
        fi
        # Only running out of memory makes a smaller micro-batch worth trying.
        grep -qiE 'out of memory|OutOfMemory|memory' "$out/merak-$model.log" || break
    done
    mbs=${mbs:-8}
    timed "merak-fp32-$model" merak train "${common[@]}" --set train.precision=fp32 \
        --set train.micro_batch="$mbs" --set train.global_batch="$mbs" --out "$out/merak-fp32-$model"
    for variant in "eager fp32" "eager bf16" "compile bf16"; do
        read -r mode precision <<<"$variant"
        local flags=(--device cuda --precision "$precision")
        [ "$mode" = compile ] && flags+=(--compile)
        timed "torch-$model-$mode-$precision" "$python" benches/pytorch/gpt_train.py "${flags[@]}" \
            --vocab 50257 --layers "$layers" --hidden "$hidden" --heads "$heads" --seq 1024 \
            --batch "$mbs" --steps "$steps" --warmup 2 --threads 8 \
            --out "$out/torch-$model-$mode-$precision.jsonl"
    done
    timed "megatron-$model" "$python" benches/gpu/megatron_gpt.py --vocab 50257 --layers "$layers" \
        --hidden "$hidden" --heads "$heads" --seq 1024 --batch "$mbs" --steps "$steps" --warmup 2 \
        --out "$out/megatron-$model.jsonl"
}

ranks() {
    local tiny=(--config configs/gpt-tiny.toml --set train.device=cuda --set train.steps=5
        --set train.micro_batch=2 --set checkpoint.at_end=false)
    timed tiny-1 merak train "${tiny[@]}" --out "$out/tiny-1"
    timed tiny-tp2 mpirun -np 2 --oversubscribe merak train "${tiny[@]}" --tp 2 --out "$out/tiny-tp2"
    timed tiny-pp2 mpirun -np 2 --oversubscribe merak train "${tiny[@]}" --pp 2 --out "$out/tiny-pp2"
    if timed nccl-shared mpirun -np 2 --oversubscribe merak train --config configs/gpt-tiny.toml \
        --tp 2 --set train.device=cuda --set train.comm=nccl --set train.steps=1 \
        --out "$out/nccl-shared"; then
        echo "two ranks on one GPU with NCCL were not refused"
    fi
}

# The parallel features first run on a GPU with MPI between ranks sharing it (correctness
# only), each against the one-process CUDA run of the same tiny model: the MoE GPT of
# launch/tests/experts.rs (its seed keeps a margin between routing scores) at ep = 1
# (fp32 and bf16), ep 2, ep 2 x tp 2 with sequence parallelism; the dense tiny GPT with
# sequence parallelism and with context parallelism; and the NCCL self-check, whose grouped
# send/receive is expert parallelism's token exchange (to the rank itself on one GPU).
features() {
    local tiny=(--config configs/gpt-tiny.toml --set train.device=cuda --set train.steps=5
        --set train.micro_batch=2 --set checkpoint.at_end=false)
    local moe=(--set model.moe.experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=32
        --set model.moe.shared_experts=1 --set model.moe.z_loss=0.001 --set model.dropout=0.1
        --set train.seed=7)
    local sp=(--set parallel.sequence_parallel=true)
    local np2=(mpirun -np 2 --oversubscribe) np4=(mpirun -np 4 --oversubscribe)
    timed nccl-check mpirun -np 1 merak probe --nccl
    timed tiny-1 merak train "${tiny[@]}" --out "$out/tiny-1"
    timed tiny-tp2-sp "${np2[@]}" merak train "${tiny[@]}" --tp 2 "${sp[@]}" --out "$out/tiny-tp2-sp"
    timed tiny-cp2 "${np2[@]}" merak train "${tiny[@]}" --cp 2 --out "$out/tiny-cp2"
    timed moe-1 merak train "${tiny[@]}" "${moe[@]}" --out "$out/moe-1"
    timed moe-1-bf16 merak train "${tiny[@]}" "${moe[@]}" --set train.precision=bf16 \
        --out "$out/moe-1-bf16"
    timed moe-ep2 "${np2[@]}" merak train "${tiny[@]}" "${moe[@]}" --dp 2 --ep 2 --out "$out/moe-ep2"
    timed moe-ep2-tp2-sp "${np4[@]}" merak train "${tiny[@]}" "${moe[@]}" --dp 2 --ep 2 --tp 2 \
        "${sp[@]}" --out "$out/moe-ep2-tp2-sp"
}

profile() {
    local run=(--set model.preset=gpt2 --set model.seq_len=1024 --set data.kind=synthetic
        --set train.device=cuda --set train.precision=bf16 --set train.micro_batch=16
        --set train.global_batch=16 --set checkpoint.at_end=false)
    # Unprofiled first (it also fills the PTX cache): step times, the GPU's busy share sampled
    # by nvidia-smi, and the process's CPU seconds against its wall seconds.
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 \
        >"$out/merak-plain.util" &
    local watcher=$!
    TIMEFORMAT='wall %R s, user %U s, sys %S s'
    { time timed merak-plain merak train "${run[@]}" --set train.steps=8 --out "$out/merak-plain"; } \
        2>"$out/merak-plain.cpu"
    kill "$watcher" 2>/dev/null
    # Then with every launch timed (CubeCL synchronises around each, so steps are slower).
    local steps=4 config=()
    [ -n "$own_config" ] && printf "$cache_config"'[profiling.logger]\nlevel = "basic"\nfile = "%s"\n' \
        "$out/cubecl-profile.log" >cubecl.toml
    [ -z "$own_config" ] && config=(env CUBECL_DEBUG_LOG="$out/cubecl-profile.log" CUBECL_DEBUG_OPTION=profile)
    timed merak-profiled "${config[@]}" merak train "${run[@]}" --set train.steps=$steps \
        --out "$out/merak-profiled"
    [ -n "$own_config" ] && printf "$cache_config" >cubecl.toml
    gzip -f "$out/cubecl-profile.log"
    "$python" benches/gpu/kernel_profile.py "$out/cubecl-profile.log.gz" --steps $steps \
        >"$out/kernel-profile.md" 2>&1
    # PyTorch eager bf16 on the same model and step, its last two steps profiled.
    timed torch-profiled "$python" benches/pytorch/gpt_train.py --device cuda --precision bf16 \
        --vocab 50257 --layers 12 --hidden 768 --heads 12 --seq 1024 --batch 16 --steps 6 \
        --warmup 2 --threads 8 --out "$out/torch-profiled.jsonl" --profile "$out/torch-profile.txt"
    save
}

kernels() {
    local names=(attention gelu norm xent embedding adamw squares bias) k others
    local tiny=(--config configs/gpt-tiny.toml --set train.steps=5 --set checkpoint.at_end=false)
    # One fused kernel at a time (the others composed), so a kernel the driver rejects is named;
    # the later runs keep the default (every kernel fused).
    local only=(${KERNELS_ONLY:-${names[*]}})
    if command -v merak-kernel-tests >/dev/null; then
        timed kernel-tests merak-kernel-tests kernels::cube --test-threads=1
    fi
    for k in "${only[@]}"; do
        others=$(printf '%s\n' "${names[@]}" | grep -vx "$k" | paste -sd, -)
        MERAK_COMPOSED_KERNELS=$others CUDA_LAUNCH_BLOCKING=1 timed "kernels-only-$k" merak train \
            "${tiny[@]}" --set train.device=cuda --out "$out/kernels-only-$k"
    done
    timed kernels-tiny-cpu merak train "${tiny[@]}" --set train.device=cpu --out "$out/kernels-tiny-cpu"
    timed kernels-tiny-cuda merak train "${tiny[@]}" --set train.device=cuda \
        --out "$out/kernels-tiny-cuda"
    timed kernels-tiny-cuda-bf16 merak train "${tiny[@]}" --set train.device=cuda \
        --set train.precision=bf16 --out "$out/kernels-tiny-cuda-bf16"
    # The tiled attention in bf16, on tensor cores and in its scalar form (off by default).
    local product
    for product in cmma scalar; do
        MERAK_ATTENTION_PRODUCT=$product timed "kernels-tiny-cuda-bf16-$product" merak train \
            "${tiny[@]}" --set train.device=cuda --set train.precision=bf16 \
            --out "$out/kernels-tiny-cuda-bf16-$product"
    done
    # GPT-2 small, bf16, micro-batch 16: the fused kernels against Burn's composed operators
    # (MERAK_COMPOSED_KERNELS=all) and PyTorch eager, side by side.
    local gpt=(--set model.preset=gpt2 --set model.seq_len=1024 --set data.kind=synthetic
        --set train.device=cuda --set train.precision=bf16 --set train.micro_batch=16
        --set train.global_batch=16 --set train.steps=8 --set train.warmup_steps=2
        --set checkpoint.at_end=false)
    timed kernels-gpt2-fused merak train "${gpt[@]}" --out "$out/kernels-gpt2-fused"
    MERAK_COMPOSED_KERNELS=all timed kernels-gpt2-composed merak train "${gpt[@]}" \
        --out "$out/kernels-gpt2-composed"
    [ "${KERNELS_TORCH:-1}" = 1 ] && timed kernels-torch-gpt2 "$python" benches/pytorch/gpt_train.py \
        --device cuda --precision bf16 --vocab 50257 --layers 12 --hidden 768 --heads 12 \
        --seq 1024 --batch 16 --steps 8 --warmup 2 --threads 8 --out "$out/kernels-torch-gpt2.jsonl"
    save
}

# The changes since the last GPU run, each beside what it replaces: GPT-2 small and medium,
# bf16, micro-batch 16, with the linear layers' products on the kernel table's choice (the
# default), on CubeCL's default kernel (MERAK_COMPOSED_KERNELS=matmul) and on cuBLASLt
# (MERAK_CUBLASLT=1); the attention on the tiled kernel with tensor cores and with its scalar
# product (MERAK_ATTENTION_PRODUCT) instead of Burn's; cuBLASLt and tensor cores together.
changes() {
    local model
    for model in ${CHANGES_MODELS:-gpt2 gpt2-medium}; do
        local gpt=(--set model.preset=$model --set model.seq_len=1024 --set data.kind=synthetic
            --set train.device=cuda --set train.precision=bf16 --set train.micro_batch=16
            --set train.global_batch=16 --set train.steps="$steps" --set train.warmup_steps=2
            --set checkpoint.at_end=false)
        timed "changes-$model-bf16" merak train "${gpt[@]}" --out "$out/changes-$model-bf16"
        MERAK_COMPOSED_KERNELS=matmul timed "changes-$model-bf16-default-matmul" merak train \
            "${gpt[@]}" --out "$out/changes-$model-bf16-default-matmul"
        MERAK_CUBLASLT=1 timed "changes-$model-bf16-cublaslt" merak train "${gpt[@]}" \
            --out "$out/changes-$model-bf16-cublaslt"
        local product
        for product in cmma scalar; do
            MERAK_ATTENTION_PRODUCT=$product timed "changes-$model-bf16-attention-$product" \
                merak train "${gpt[@]}" --out "$out/changes-$model-bf16-attention-$product"
        done
        MERAK_CUBLASLT=1 MERAK_ATTENTION_PRODUCT=cmma timed "changes-$model-bf16-both" \
            merak train "${gpt[@]}" --out "$out/changes-$model-bf16-both"
    done
    save
}

# PyTorch eager bf16 on GPT-2 small at micro-batch 16 (the ratio's reference in the same run).
torch_small() {
    timed torch-gpt2-eager-bf16 "$python" benches/pytorch/gpt_train.py --device cuda \
        --precision bf16 --vocab 50257 --layers 12 --hidden 768 --heads 12 --seq 1024 --batch 16 \
        --steps "$steps" --warmup 2 --threads 8 --out "$out/torch-gpt2-eager-bf16.jsonl"
}

# CubeCL's autotuner once, with the build that has it (gpu-bundle/bin/merak-autotune.gz, from
# FEATURES=cuda-autotune scripts/gpu-bundle.sh, copied beside merak.gz): GPT-2 small, bf16,
# micro-batch 16, 3 steps at the `minimal` level with the tuning cache written under
# RESULTS/autotune (saved every 30 s, so a run cut short still brings back what it tuned), then
# 8 steps with that cache warm. TUNE_LIMIT_S (default 400) bounds the tuning run.
tune() {
    local bin=/tmp/merak-autotune saver
    if [ ! -f gpu-bundle/bin/merak-autotune.gz ] || [ -z "$own_config" ]; then
        echo "tune: needs gpu-bundle/bin/merak-autotune.gz and no cubecl.toml of the repository's"
        return 1
    fi
    gzip -dc gpu-bundle/bin/merak-autotune.gz >"$bin" && chmod +x "$bin" || return 1
    printf "$cache_config"'[autotune]\nlevel = "minimal"\ncache = { file = "%s" }\n' \
        "$out/autotune" >cubecl.toml
    local gpt=(--set model.preset=gpt2 --set model.seq_len=1024 --set data.kind=synthetic
        --set train.device=cuda --set train.precision=bf16 --set train.micro_batch=16
        --set train.global_batch=16 --set train.warmup_steps=2 --set checkpoint.at_end=false)
    (while sleep 30; do save; done) &
    saver=$!
    limit=${TUNE_LIMIT_S:-400} timed tune-gpt2-bf16 "$bin" train "${gpt[@]}" --set train.steps=3 \
        --out "$out/tune-gpt2-bf16"
    kill "$saver" 2>/dev/null
    timed tuned-gpt2-bf16 "$bin" train "${gpt[@]}" --set train.steps="$steps" \
        --out "$out/tuned-gpt2-bf16"
    printf "$cache_config" >cubecl.toml
    save
}

report() {
    local peak=()
    [ -n "${PEAK_TFLOPS:-}" ] && peak=(--peak-tflops "$PEAK_TFLOPS")
    "$python" benches/gpu/report.py "$out" "${peak[@]}" | tee "$out/report.md"
    save
}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(smoke small ranks medium report)
for phase in "${phases[@]}"; do
    echo "== $phase ($(date -u +%H:%M:%S))"
    case $phase in
        smoke) smoke || { echo "smoke failed: merak cannot train on this GPU (see $out)"; exit 1; } ;;
        small) compare gpt2 ;;
        medium) compare gpt2-medium ;;
        ranks) ranks ;;
        features) features ;;
        profile) profile ;;
        kernels) kernels ;;
        changes) changes ;;
        torch-small) torch_small ;;
        tune) tune ;;
        report) report ;;
        *) echo "unknown phase $phase (smoke, small, medium, ranks, features, profile, kernels, changes, torch-small, tune, report)" >&2; exit 2 ;;
    esac
done
