#!/usr/bin/env bash
# One-H200 batch for issue 17's bf16 check: recipes/bench_h200.yaml trained twice on the same data, side by
# side on the one GPU: A = the float32 reference path (precision.dtype=fp32, reference attention kernels),
# B = bf16 with the Triton kernels as shipped plus B_OVERRIDES (e.g. "compile.enable=true"). STEPS (default
# "80 20 100": dense, warm-up, sparse) at SEQ tokens per sequence (default 4096: the float32 reference path took
# 3.3 s per 8K step in layouts_gpu.py, so 200 4K steps should fit one call; not yet run). Then benchmarks/compare_runs.py A B (windows of 20
# steps, limit 2%): $OUT/compare.txt, the two logs, both metrics.jsonl.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
read -r S0 S1 S2 <<< "${STEPS:-80 20 100}"
SEQ=${SEQ:-4096}
COMMON="curriculum.stages.0.steps=$S0 curriculum.stages.1.steps=$S1 curriculum.stages.2.steps=$S2 logging.interval_steps=1"
for i in 0 1 2; do COMMON="$COMMON curriculum.stages.$i.seq_len=$SEQ"; done
run() {  # name, overrides...
    local name=$1; shift
    mkdir -p /tmp/ws_$name/.v4launch && (cd /tmp/ws_$name && timeout ${RUN_TIMEOUT:-540} python3 -m v4launch run \
        $REPO/recipes/bench_h200.yaml --no-progress $COMMON "$@" > $OUT/${name}.log 2>&1; echo "$name exit $?")
    cp /tmp/ws_$name/runs/*/metrics.jsonl $OUT/${name}_metrics.jsonl 2>/dev/null
}
run fp32_reference precision.dtype=fp32 attention.kernel_backend=reference &
run bf16_kernels ${B_OVERRIDES:-} &
wait
grep -hE "held-out|memory|completed" $OUT/fp32_reference.log $OUT/bf16_kernels.log | cut -c1-160
python3 $REPO/benchmarks/compare_runs.py $OUT/fp32_reference_metrics.jsonl $OUT/bf16_kernels_metrics.jsonl \
    --window ${WINDOW:-20} --limit ${LIMIT:-0.02} | tee $OUT/compare.txt
