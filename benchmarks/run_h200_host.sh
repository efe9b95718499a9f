#!/usr/bin/env bash
# One-H200 batch for issue 17's host-bound step: benchmarks/train_step.py --compile in PHASES (default sparse),
# once per VARIANTS entry "name:ENV=value,ENV2=value" (default: the step as shipped, and inductor's C++ wrapper,
# which launches a compiled graph's kernels from C++ instead of Python). Each writes $OUT/<name>/train_step.txt
# with the ms/step and host ms columns, and the profile's host table (table_host_*.txt: ops by self CPU time,
# kernel launches per step). About 80 s per variant and phase (compiling included). EXTRA: more train_step.py
# arguments (e.g. "--sync-trace": one more step under CUDA sync debug mode, where the host waits).
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
PHASES=${PHASES:-sparse}
VARIANTS=${VARIANTS:-"shipped: cpp_wrapper:TORCHINDUCTOR_CPP_WRAPPER=1"}
for v in $VARIANTS; do
    name=${v%%:*}; envs=${v#*:}
    mkdir -p $OUT/$name
    (cd /tmp && env ${envs//,/ } timeout ${STEP_TIMEOUT:-240} python3 $REPO/benchmarks/train_step.py --compile \
        --phases $PHASES --parity-tokens 0 --profile $OUT/$name/prof --out $OUT/$name ${EXTRA:-} \
        > $OUT/$name/train_step.txt 2>&1; echo "$name exit $?")
    grep -E "^(dense|warmup|sparse) |kernel launches|^host:|sync trace|^  x" $OUT/$name/train_step.txt
    grep -A12 "^host:" $OUT/$name/train_step.txt | tail -12 | cut -c1-150
done
