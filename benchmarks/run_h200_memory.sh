#!/usr/bin/env bash
# One-H200 batch for the memory plan (V4-MEMORY) and whole-layer recompute. Parts (PARTS, default all):
#   layers   benchmarks/memory_calibration.py: Flash-width layers at 8K-128K, with and without
#            recompute_granularity=full, measured beside the plan (memory_calibration.{json,txt})
#   tiny     recipes/tiny_cpu.yaml through `v4launch run` on the GPU (one rank: the cp 2 stage at cp 1),
#            its `memory` event beside the plan (tiny_run.log, tiny_plan.txt)
#   bench    recipes/bench_h200.yaml through `v4launch run` with recompute_granularity=full (bench_full.log,
#            bench_full_plan.txt), then benchmarks/recompute_memory.py on the bench shape: none vs full
#            (recompute_bench.{json,txt})
#   optim    benchmarks/optimizer_step.py on the bench recipe (optimizer_step.txt)
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
PARTS=${PARTS:-layers tiny bench optim}
plan() {  # recipe + overrides -> the plan's allocated GiB (without headroom) of every stage
    (cd /tmp && python3 - "$REPO/$1" "${@:2}") <<'PY'
import sys
from pathlib import Path
from v4launch.training.recipe_io import load_recipe
from v4launch.validators.memory_plan import memory_plan
r = load_recipe(Path(sys.argv[1]), sys.argv[2:]).recipe  # run from /tmp: the repo's v4launch/ would shadow the install
for i, st in enumerate(r.curriculum.stages):
    p = memory_plan(r, i)
    print(f"plan {st.name}: allocated {p.allocated_bytes / 2**30:.3f} GiB (total with headroom {p.total_bytes / 2**30:.3f})")
PY
}
for part in $PARTS; do
  case $part in
  layers)
    timeout ${LAYERS_TIMEOUT:-330} python3 benchmarks/memory_calibration.py --json $OUT/memory_calibration.json \
        --rows none:2:8192 none:2:32768 full:2:65536 full:4:65536 full:8:65536 none:2:65536 \
        2>&1 | tee $OUT/memory_calibration.txt | grep -v Warning ;;
  tiny)
    TINY="cluster.gpu=H200 cluster.gpus_per_node=1 curriculum.stages.2.cp=1"
    mkdir -p /tmp/ws_tiny/.v4launch && (cd /tmp/ws_tiny && timeout ${TINY_TIMEOUT:-200} python3 -m v4launch run \
        $REPO/recipes/tiny_cpu.yaml --no-progress $TINY > $OUT/tiny_run.log 2>&1; echo "tiny exit $?")
    grep -E "memory|completed|eval" $OUT/tiny_run.log | cut -c1-220
    plan recipes/tiny_cpu.yaml $TINY | tee $OUT/tiny_plan.txt ;;
  bench)
    FULL="parallel.recompute_granularity=full"
    mkdir -p /tmp/ws_bench/.v4launch && (cd /tmp/ws_bench && timeout ${BENCH_TIMEOUT:-200} python3 -m v4launch run \
        $REPO/recipes/bench_h200.yaml --no-progress $FULL logging.interval_steps=1 curriculum.stages.0.steps=12 \
        curriculum.stages.1.steps=4 curriculum.stages.2.steps=12 > $OUT/bench_full.log 2>&1; echo "bench exit $?")
    grep -E "step (2|6|10|12|16|20|28)/|memory|recompute|completed" $OUT/bench_full.log | cut -c1-220
    plan recipes/bench_h200.yaml $FULL | tee $OUT/bench_full_plan.txt
    timeout ${RECOMPUTE_TIMEOUT:-150} python3 benchmarks/recompute_memory.py --shape bench --device cuda --kernels triton \
        --configs none,full --steps 6 --json $OUT/recompute_bench.json 2>&1 | tee $OUT/recompute_bench.txt | tail -6 ;;
  optim)
    timeout ${OPTIM_TIMEOUT:-120} python3 benchmarks/optimizer_step.py --recipe recipes/bench_h200.yaml \
        2>&1 | tee $OUT/optimizer_step.txt | tail -8 ;;
  esac
done
