#!/usr/bin/env bash
# The 2-GPU layout runs of issue 22 on an nvidia-h200-x2 machine (no internet: the Python packages the
# launcher needs travel as cp312 wheels in .whl/). Writes under $OUT: layouts_h200x2.json / .txt
# (benchmarks/layouts_gpu.py) and flash_debug_h200x2.log (a phase change and a stop/resume over NCCL).
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
timeout ${LAYOUT_TIMEOUT:-380} python3 benchmarks/layouts_gpu.py --gpus 2 --steps ${STEPS:-8} ${ONLY:+--only $ONLY} \
    --out $OUT/layouts_h200x2.json 2>&1 | tee $OUT/layouts_h200x2.txt
mkdir -p /tmp/fdws/.v4launch && cd /tmp/fdws
FD="cluster.gpus_per_node=2 cluster.gpu=H200 parallel.pp=1 parallel.vpp=1 parallel.pp_layout=null logging.tensorboard=false"
{ timeout 150 python3 -m v4launch run $REPO/recipes/flash_debug.yaml --max-steps 48 --no-progress $FD; echo "exit $?";
  timeout 120 python3 -m v4launch resume --no-progress; echo "exit $?"; } > $OUT/flash_debug_h200x2.log 2>&1
tail -25 $OUT/flash_debug_h200x2.log
