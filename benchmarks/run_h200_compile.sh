#!/usr/bin/env bash
# One-H200 batch for issue 17 (compile.enable through the product) and issue 18 (the tiny row's peak).
# Parts (PARTS, default all):
#   peak      recipes/tiny_cpu.yaml on the GPU (one rank) under benchmarks/peak_breakdown.py: what is alive
#             at the job's CUDA memory peak (peak/peak_<pid>.txt, tiny_peak.log); PEAK_BACKGROUND=1 runs it
#             beside the next part (it takes well under 1 GiB of the GPU)
#   product   recipes/bench_h200.yaml through `v4launch run`, short stages, one run per VARIANTS entry
#             (a name and its overrides): bench_<name>.log
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
PARTS=${PARTS:-peak product}
python3 -c "import torch; print('dynamo lru switch:', hasattr(torch._C._dynamo.eval_frame, '_set_lru_cache'))"
SHORT="curriculum.stages.0.steps=${DENSE_STEPS:-12} curriculum.stages.1.steps=${WARMUP_STEPS:-4} curriculum.stages.2.steps=${SPARSE_STEPS:-12} logging.interval_steps=1"
for part in $PARTS; do
  case $part in
  peak)
    TINY="cluster.gpu=H200 cluster.gpus_per_node=1 curriculum.stages.2.cp=1 ${TINY_STEPS:-curriculum.stages.0.steps=3 curriculum.stages.1.steps=2 curriculum.stages.2.steps=3}"
    mkdir -p /tmp/ws_peak/.v4launch && (cd /tmp/ws_peak && timeout ${PEAK_TIMEOUT:-240} python3 $REPO/benchmarks/peak_breakdown.py \
        --entries ${PEAK_ENTRIES:-2000000} --out $OUT/peak -- python3 -m v4launch run $REPO/recipes/tiny_cpu.yaml \
        --no-progress $TINY > $OUT/tiny_peak.log 2>&1; echo "tiny peak exit $?"; grep -E "memory|completed" $OUT/tiny_peak.log \
        | cut -c1-200; head -30 $OUT/peak/peak_*.txt) &
    [ "${PEAK_BACKGROUND:-0}" = 1 ] || wait ;;
  product)
    for v in ${VARIANTS:-eager:run.deterministic=true compile:compile.enable=true}; do
      name=${v%%:*}; over=$(echo ${v#*:} | tr ',' ' ')
      mkdir -p /tmp/ws_$name/.v4launch && (cd /tmp/ws_$name && timeout ${RUN_TIMEOUT:-240} python3 -m v4launch run \
          $REPO/recipes/bench_h200.yaml --no-progress $SHORT $over > $OUT/bench_$name.log 2>&1; echo "bench $name exit $?")
      grep -E "step ([2-9]|1[0-9]|2[0-9])/|compile|memory|completed|Error|error" $OUT/bench_$name.log | cut -c1-160 | head -40
    done ;;
  esac
done
wait
