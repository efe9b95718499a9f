#!/usr/bin/env bash
# One-H200 batch: does bf16 training (and each storage / offload option) track the float32 reference?
# recipes/bench_h200.yaml trained on the same data, side by side on the one GPU, STEPS (default "80 20 100":
# dense, warm-up, sparse) at SEQ tokens per sequence (default 4096):
#   fp32_reference  precision.dtype=fp32 on the reference attention kernels, eager (no compile, no CUDA graph:
#                   V4-CUDA-GRAPH refuses a graph in float32 compute)
#   bf16_kernels    bf16 with the Triton kernels as shipped (compiled blocks + CUDA graphs) plus B_OVERRIDES
#   bf16_storage    bf16_kernels with precision-aware storage: bf16 GEMM weights + 16-bit remainders, bf16 moments
#   bf16_offload    bf16_kernels with whole-layer recompute and the layer inputs in host memory (no CUDA graph:
#                   host copies cannot be captured)
#   fp8_kernels     bf16_kernels with precision.fp8_recipe=${FP8_RECIPE:-blockwise}: the V4 FP8 policy (routed experts
#                   through model/fp8_experts.py, Float8Linear elsewhere), compiled, CUDA graphs
# VARIANTS picks a subset (default the first four), WAVE of them at a time (default 2). Then benchmarks/compare_runs.py of each
# against BASELINE (default fp32_reference; BASELINE=bf16_kernels for FP8) (windows of 20 steps, limit 2%): $OUT/compare_<variant>.txt, the logs, every metrics.jsonl.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
read -r S0 S1 S2 <<< "${STEPS:-80 20 100}"
SEQ=${SEQ:-4096}
VARIANTS=${VARIANTS:-fp32_reference bf16_kernels bf16_storage bf16_offload}
# one checkpoint per run, deleted when the run ends: four runs' checkpoints of the ~1.1 B-parameter model with its
# optimizer state filled the machine's 64 GiB disk on 2026-12-04 (benchmarks/results/loss_curve_storage_h200_*)
COMMON="curriculum.stages.0.steps=$S0 curriculum.stages.1.steps=$S1 curriculum.stages.2.steps=$S2 logging.interval_steps=1 checkpointing.keep_last=1"
for i in 0 1 2; do COMMON="$COMMON curriculum.stages.$i.seq_len=$SEQ"; done
STORAGE="precision.params_dtype=bf16 precision.store_param_remainders=true precision.exp_avg_dtype=bf16 precision.exp_avg_sq_dtype=bf16"
OFFLOAD="parallel.recompute_granularity=full parallel.cpu_offloading=true compile.cuda_graph=false"
# SHM_VARIANTS: variants whose workspace (and checkpoints) lie in /dev/shm, when it has 40 GiB free, so that more
# runs fit at once than the disk holds
shm_free_gib=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
run() {  # name, overrides...
    local name=$1; shift
    local root=/tmp
    case " ${SHM_VARIANTS:-} " in *" $name "*) [ "${shm_free_gib:-0}" -ge 40 ] && root=/dev/shm ;; esac
    mkdir -p $root/ws_$name/.v4launch && (cd $root/ws_$name && timeout ${RUN_TIMEOUT:-540} python3 -m v4launch run \
        $REPO/recipes/bench_h200.yaml --no-progress $COMMON "$@" > $OUT/${name}.log 2>&1; echo "$name exit $? (workspace in $root)")
    cp $root/ws_$name/runs/*/metrics.jsonl $OUT/${name}_metrics.jsonl 2>/dev/null
    rm -rf $root/ws_$name/runs/*/checkpoints
}
WAVE=${WAVE:-2}  # variants run at once (the disk holds about two runs' checkpoints)
n=0
for v in $VARIANTS; do
  [ $n -gt 0 ] && [ $((n % WAVE)) -eq 0 ] && wait
  n=$((n + 1))
  case $v in
  fp32_reference) run fp32_reference precision.dtype=fp32 attention.kernel_backend=reference compile.enable=false \
                      compile.cuda_graph=false & ;;
  bf16_kernels) run bf16_kernels ${B_OVERRIDES:-} & ;;
  bf16_storage) run bf16_storage $STORAGE ${B_OVERRIDES:-} & ;;
  bf16_offload) run bf16_offload $OFFLOAD ${B_OVERRIDES:-} & ;;
  fp8_kernels) run fp8_kernels precision.fp8_recipe=${FP8_RECIPE:-blockwise} ${B_OVERRIDES:-} & ;;
  esac
done
wait
for v in $VARIANTS; do grep -hE "held-out|memory|completed|Error" $OUT/$v.log | cut -c1-160 | sed "s/^/$v: /"; done
BASELINE=${BASELINE:-fp32_reference}
# BASELINE_METRICS: a committed metrics.jsonl of the baseline run (same STEPS, SEQ and recipe), so that only the
# new variant runs, e.g. BASELINE_METRICS=benchmarks/results/loss_curve_fp8_h100_2026-12-05/bf16_kernels_metrics.jsonl
# with VARIANTS=fp8_kernels BASELINE=bf16_kernels SEQ=2048 STEPS="60 20 120"
[ -n "${BASELINE_METRICS:-}" ] && cp "$REPO/$BASELINE_METRICS" $OUT/${BASELINE}_metrics.jsonl
for v in $VARIANTS; do
  [ "$v" = "$BASELINE" ] && continue
  echo "== $v against $BASELINE"
  python3 $REPO/benchmarks/compare_runs.py $OUT/${BASELINE}_metrics.jsonl $OUT/${v}_metrics.jsonl \
      --window ${WINDOW:-20} --limit ${LIMIT:-0.02} | tee $OUT/compare_$v.txt
done
