#!/usr/bin/env bash
# Whether two `merak` binaries train alike: the losses of `merak train` (6 steps of the built-in
# default) under one process, dp 2, tp 2 with sequence parallelism, pp 2, cp 2, a mixture of
# experts at dp 2 x ep 2 and at tp 2 (with SP) x dp 2 with ZeRO-2, and BERT at tp 2, compared
# exactly; `merak export` of the first binary's checkpoint by both, compared byte for byte;
# and that checkpoint resumed by both.
# For a refactor that must not change training (build the old commit in a worktree first).
#
#   scripts/same-training.sh OLD/target/release/merak target/release/merak
#
# Everything is written into a new temporary folder, printed at the end.
set -u
OLD=$1
NEW=$2
D=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1
status=0

losses() {
    python3 -c "import json,sys; print([json.loads(l)['loss'] for l in open(sys.argv[1]) if 'loss' in json.loads(l)])" "$1"
}

train() { # name ranks args...
    local name=$1 np=$2
    shift 2
    for side in old new; do
        local bin=$OLD
        [ "$side" = new ] && bin=$NEW
        local launch=()
        [ "$np" -gt 1 ] && launch=(mpirun --oversubscribe --bind-to none -np "$np")
        if ! "${launch[@]}" "$bin" train --set train.steps=6 --out "$D/$side-$name" "$@" \
            >"$D/$side-$name.log" 2>&1; then
            echo "$name: $side failed (see $D/$side-$name.log)"
            status=1
            return
        fi
    done
    local a b
    a=$(losses "$D/old-$name/metrics.jsonl")
    b=$(losses "$D/new-$name/metrics.jsonl")
    if [ "$a" = "$b" ]; then
        echo "$name: identical $a"
    else
        echo "$name: DIFFER old $a new $b"
        status=1
    fi
}

train single 1
train dp2 2 --dp 2
train tp2-sp 2 --tp 2 --set parallel.sequence_parallel=true
train pp2 2 --pp 2
train cp2 2 --cp 2
train moe-dp2-ep2 2 --dp 2 --ep 2 --set model.preset=moe-tiny
train moe-tp2-sp-dp2-zero2 4 --tp 2 --dp 2 --set model.preset=moe-tiny --set parallel.sequence_parallel=true --set parallel.zero=2
train bert-tp2 2 --tp 2 --set model.kind=bert

checkpoint=$D/old-single/checkpoints
"$OLD" export --checkpoint "$checkpoint" --output "$D/export-old/model.safetensors" >/dev/null 2>&1
"$NEW" export --checkpoint "$checkpoint" --output "$D/export-new/model.safetensors" >/dev/null 2>&1
if cmp -s "$D/export-old/model.safetensors" "$D/export-new/model.safetensors" &&
    cmp -s "$D/export-old/config.json" "$D/export-new/config.json"; then
    echo "export: byte-identical"
else
    echo "export: DIFFER"
    status=1
fi

for side in old new; do
    bin=$OLD
    [ "$side" = new ] && bin=$NEW
    "$bin" train --resume "$checkpoint" --set train.steps=8 --out "$D/resumed-$side" \
        >"$D/resumed-$side.log" 2>&1 || { echo "resume: $side failed"; status=1; }
done
a=$(losses "$D/resumed-old/metrics.jsonl" 2>/dev/null)
b=$(losses "$D/resumed-new/metrics.jsonl" 2>/dev/null)
if [ -n "$a" ] && [ "$a" = "$b" ]; then
    echo "resume of the old checkpoint: identical $a"
else
    echo "resume of the old checkpoint: DIFFER old $a new $b"
    status=1
fi
echo "files: $D"
exit $status
