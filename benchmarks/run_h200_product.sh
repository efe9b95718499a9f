#!/usr/bin/env bash
# One-H200 batch: recipes/bench_h200.yaml through `v4launch run` (the product path: data, phases,
# checkpoints, logging) and the one-GPU rows of benchmarks/layouts_gpu.py (float32 truth and bf16).
# Packages travel as cp312 wheels in .whl/. Writes bench_h200_run.log and layouts_h200x1.{json,txt} under $OUT.
# EXTRA: more overrides for the run (e.g. EXTRA="compile.enable=true parallel.global_batch_size=8
# optimizer.name=adamw"); LAYOUT_TIMEOUT=0 skips the layouts rows.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
mkdir -p /tmp/ws/.v4launch && cd /tmp/ws
timeout ${RUN_TIMEOUT:-300} python3 -m v4launch run $REPO/recipes/bench_h200.yaml --no-progress \
    curriculum.stages.0.steps=20 curriculum.stages.1.steps=6 curriculum.stages.2.steps=20 ${EXTRA:-} > $OUT/bench_h200_run.log 2>&1
echo "bench_h200 exit $?"; grep -E "step (1|5|10|15|20|21|26|30|35|40|46)/|eval|phase|memory|completed" $OUT/bench_h200_run.log | cut -c1-200
cd $REPO
[ "${LAYOUT_TIMEOUT:-200}" = 0 ] && exit 0
timeout ${LAYOUT_TIMEOUT:-200} python3 benchmarks/layouts_gpu.py --gpus 1 --steps 6 --only 1gpu-fp32 1gpu-bf16 \
    --out $OUT/layouts_h200x1.json > $OUT/layouts_h200x1.txt 2>&1
tail -5 $OUT/layouts_h200x1.txt
