#!/usr/bin/env bash
# One-H200 batch for the gap between the product and the benchmark (issue 17's 90%), both at the product's
# precision: benchmarks/train_step.py --compile --cuda-graph --fp32-params in the sparse phase (float32
# parameters under bf16 autocast, as `v4launch run` trains), then recipes/bench_h200.yaml through `v4launch run`
# (40 dense + 2 warm-up + 40 sparse steps, logging every step) profiled over PROFILE (default 70:72, sparse).
# Writes under $OUT: sparse/train_step.{txt,json}, bench_h200_run.log, metrics.jsonl and the profile's table and
# Chrome trace. STEP_TIMEOUT (default 300) and RUN_TIMEOUT (default 300) bound the two parts; PARTS (default
# "bench product") picks them; DENSE / WARMUP / SPARSE (default 40 / 2 / 40) are the stages' steps.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
PARTS=${PARTS:-"bench product"}
[[ " $PARTS " == *" bench "* ]] && PHASES=sparse STEP_TIMEOUT=${STEP_TIMEOUT:-300} EXTRA="--cuda-graph --fp32-params" bash "$REPO/benchmarks/run_h200_phases.sh" \
    | grep -vE "^(GPU|torch) "
[[ " $PARTS " == *" product "* ]] || exit 0
mkdir -p /tmp/ws/.v4launch && cd /tmp/ws
V4LAUNCH_PROFILE_STEPS=${PROFILE:-70:72} timeout ${RUN_TIMEOUT:-300} python3 -m v4launch run "$REPO/recipes/bench_h200.yaml" \
    --no-progress curriculum.stages.0.steps=${DENSE:-40} \
    curriculum.stages.1.steps=${WARMUP:-2} curriculum.stages.2.steps=${SPARSE:-40} \
    logging.interval_steps=1 ${EXTRA:-} > $OUT/bench_h200_run.log 2>&1
echo "bench_h200 exit $?"
cp runs/*/metrics.jsonl runs/*/profile/* $OUT/ 2>/dev/null
python3 - "$OUT/metrics.jsonl" <<'PY'
import json, statistics as st, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in recs if r.get("kind") == "train"]
for stage in dict.fromkeys(r["stage"] for r in train):
    rs = [r for r in train if r["stage"] == stage]
    steady = [r["step_time_s"] * 1e3 for r in rs[2:-1]]
    if steady:
        print(f"{stage}: {len(steady)} steady steps, median {st.median(steady):.1f} ms "
              f"({min(steady):.1f}-{max(steady):.1f}), {8192 / st.median(steady) * 1e3:,.0f} tokens/s at 8,192 tokens")
PY
head -3 $OUT/rank0_steps*.txt; sed -n '/most calls per step/,$p' $OUT/rank0_steps*.txt | cut -c1-160
