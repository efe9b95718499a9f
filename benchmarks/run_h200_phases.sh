#!/usr/bin/env bash
# One-H200 batch: benchmarks/train_step.py --compile once per phase, each in its own process with its own time
# limit, so that one phase's compiling cannot use up another's time (on 2026-12-02 `--phases dense,sparse` in one
# process spent the call's limit on the dense phase and never reached the sparse one).
# PHASES (default "sparse warmup dense", in that order), STEP_TIMEOUT per phase (default 200 s), EXTRA more
# train_step.py arguments (e.g. "--cuda-graph", "--profile $OUT/prof"). Each phase writes $OUT/<phase>/train_step.txt
# and .json; the table rows are printed as they come.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
for phase in ${PHASES:-sparse warmup dense}; do
    mkdir -p $OUT/$phase
    (cd /tmp && timeout ${STEP_TIMEOUT:-200} python3 $REPO/benchmarks/train_step.py --compile --phases $phase \
        --parity-tokens 0 --out $OUT/$phase ${EXTRA:-} > $OUT/$phase/train_step.txt 2>&1; echo "$phase exit $?")
    grep -E "^(dense|warmup|sparse) |peak measured|kernel launches" $OUT/$phase/train_step.txt | sort -u
done
