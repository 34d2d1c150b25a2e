#!/bin/bash
# Starts a `merak train` job again after a failure, from the run's newest checkpoint, for
# launchers that cannot restart ranks themselves (a bare mpirun, srun): a rank that dies ends
# the whole job, with the launcher's status for it (137 for SIGKILL).
#
#   OUT=runs/a MAX_RESTARTS=3 scripts/restart-loop.sh \
#       mpirun -np 4 merak train --config configs/gpt-tiny.toml --dp 4
#
# The arguments are the job's command line without --out and --resume: the loop adds
# `--out $OUT --max-restarts $MAX_RESTARTS` to every start, and `--resume $OUT/checkpoints`
# once the run has a checkpoint there (the default checkpoint folder). The ranks decide
# whether a start may go on (see `merak train --help`, --max-restarts): after a second failure
# in a row in the same step, more than MAX_RESTARTS failures, or a failure before the first
# checkpoint they refuse it with exit status 2, which ends the loop. Exit status: the last
# start's (0 done, 2 refused, 75 stopped on a signal after a checkpoint, 130 ended at once).
# See docs/src/reference/failures.md.
set -uo pipefail

: "${OUT:?set OUT to the run folder}"
MAX_RESTARTS=${MAX_RESTARTS:-3}

while :; do
    resume=()
    if [ -e "$OUT/checkpoints/latest" ]; then
        resume=(--resume "$OUT/checkpoints")
    fi
    "$@" "${resume[@]}" --out "$OUT" --max-restarts "$MAX_RESTARTS"
    status=$?
    case "$status" in
        0 | 2 | 75 | 130) exit "$status" ;;
    esac
    echo "merak: the job ended with status $status; starting it again from $OUT" >&2
done
