#!/usr/bin/env bash
# One-H200 batch for precision-aware storage and activation offload (V4-Flash on 4 nodes). Parts (PARTS, default all):
#   tests    the GPU cases of tests/model/test_offload.py, tests/model/test_param_storage.py and
#            tests/training/test_optim_storage.py (gpu_tests.txt)
#   calib    benchmarks/memory_calibration.py: Flash-width layers with whole-layer recompute at 65536 tokens, as
#            shipped, with bf16 storage, with offload, with both, beside the plan (memory_calibration_storage.{json,txt})
#   offload  benchmarks/offload_step.py: forward + backward time and memory with and without offload (offload_step.*)
#   optim    benchmarks/optimizer_step.py --storage on the bench recipe: fp32 vs bf16 storage (optimizer_storage.txt)
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
PARTS=${PARTS:-tests calib offload optim}
for part in $PARTS; do
  case $part in
  tests)
    # from /tmp with --rootdir: the checkout's v4launch/ would shadow the installed package (run_h200_tests.sh)
    (cd /tmp && timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir=/tmp \
        $REPO/tests/model/test_offload.py $REPO/tests/model/test_param_storage.py \
        $REPO/tests/training/test_optim_storage.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests exit $?")
    tail -4 $OUT/gpu_tests.txt ;;
  calib)
    timeout ${CALIB_TIMEOUT:-240} python3 benchmarks/memory_calibration.py --json $OUT/memory_calibration_storage.json \
        --rows ${ROWS:-full:4:65536 full:4:65536:bf16 full:4:65536:offload full:4:65536:bf16+offload \
                full:8:65536:bf16+offload none:2:32768:bf16} \
        2>&1 | tee $OUT/memory_calibration_storage.txt | grep -v Warning ;;
  offload)
    timeout ${OFFLOAD_TIMEOUT:-200} python3 benchmarks/offload_step.py --json $OUT/offload_step.json \
        2>&1 | tee $OUT/offload_step.txt | tail -8 ;;
  optim)
    timeout ${OPTIM_TIMEOUT:-120} python3 benchmarks/optimizer_step.py --recipe recipes/bench_h200.yaml --storage \
        2>&1 | tee $OUT/optimizer_storage.txt | tail -5 ;;
  esac
done
