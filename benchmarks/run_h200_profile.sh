#!/usr/bin/env bash
# One-H200 batch: torch.profiler tables of the product path (recipes/bench_h200.yaml through `v4launch run`,
# V4LAUNCH_PROFILE_STEPS) in the dense stage (steps 6-8) and the sparse stage (steps 9-11 of a run whose
# dense and warm-up stages are cut to 2 + 2 steps). Writes profile_{dense,sparse}.txt and the logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
run_profiled() {  # name, steps, max steps, overrides...
    local name=$1 steps=$2 max=$3; shift 3
    mkdir -p /tmp/ws_$name/.v4launch && (cd /tmp/ws_$name && V4LAUNCH_PROFILE_STEPS=$steps timeout ${RUN_TIMEOUT:-240} \
        python3 -m v4launch run $REPO/recipes/bench_h200.yaml --no-progress --max-steps $max logging.interval_steps=1 "$@" \
        > $OUT/${name}_run.log 2>&1; echo "$name exit $?")
    cp /tmp/ws_$name/runs/*/profile/rank0_steps*.txt $OUT/profile_$name.txt 2>/dev/null
    grep -E "tok/s|profile|memory" $OUT/${name}_run.log | cut -c1-200 | tail -6
    head -30 $OUT/profile_$name.txt | cut -c1-240
}
run_profiled dense 6:8 9
run_profiled sparse 9:11 12 curriculum.stages.0.steps=2 curriculum.stages.1.steps=2 curriculum.stages.2.steps=10
