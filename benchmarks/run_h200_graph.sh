#!/usr/bin/env bash
# One-H200 batch for compile.cuda_graph: the GPU capture test (tests/training/test_cuda_graph_step.py, its compiled
# case included; TESTS_TIMEOUT default 330 s: the compiled case compiles on a cold cache), then
# recipes/bench_h200.yaml through `v4launch run` (compiled blocks, graph on) for STEPS optimizer steps (default 30,
# in the dense stage), profiled over PROFILE (default 24:26), with TORCH_LOGS=recompiles (a block compiled inside
# the capture fails it; the log names the guard). EXTRA: more overrides, e.g. compile.enable=false.
# Writes under $OUT: gpu_tests.txt, graph_run.log, the profile table and any cuda_graph_capture_rank*.txt.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
TESTS="tests/training/test_cuda_graph_step.py" TESTS_TIMEOUT=${TESTS_TIMEOUT:-330} bash "$REPO/benchmarks/run_h200_tests.sh" \
    | tail -4
mkdir -p /tmp/ws/.v4launch && cd /tmp/ws
V4LAUNCH_PROFILE_STEPS=${PROFILE:-24:26} TORCH_LOGS=recompiles timeout ${RUN_TIMEOUT:-300} python3 -m v4launch run "$REPO/recipes/bench_h200.yaml" \
    --no-progress --max-steps ${STEPS:-30} logging.interval_steps=2 compile.cuda_graph=true \
    ${EXTRA:-} > $OUT/graph_run.log 2>&1
echo "graph run exit $?"
grep -E "step [0-9]+/|cuda_graph|error|hint" $OUT/graph_run.log | cut -c1-220 | tail -25
find /tmp/ws \( -name 'cuda_graph_capture_rank*.txt' -o -path '*profile*' -name '*.txt' \) -exec cp {} $OUT/ \;
