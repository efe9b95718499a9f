#!/usr/bin/env bash
# One-H200 A/B of benchmarks/train_step.py --compile between the working tree and an older commit, in one
# call: the step is host-bound, and host speed differs between the machines the device calls land on
# (the same code measured 188.6 and 213.6 ms per sparse step on two of them), so only an A/B inside one
# call compares code. Before the call: git archive BASE -o .whl/base.tar (carried with .whl).
# BASE_PHASES (default sparse) for the older commit; HEAD_RUNS: ";"-separated train_step.py argument
# lists for the working tree (default: sparse with the profile and the sync trace, then dense,warmup).
# Output: $OUT/{base,head_N}/train_step.txt and the profile tables.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
mkdir -p /tmp/base && tar -xf .whl/base.tar -C /tmp/base
pip install -q --no-index --no-deps --target /tmp/site_base .whl/*.whl >/dev/null 2>&1
pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site_base /tmp/base >/dev/null 2>&1 \
    || echo "install of the base commit failed"
run() {  # name site train_step.py-path args...   (BASE_TIMEOUT / STEP_TIMEOUT: seconds for the base / each head run)
    local name=$1 site=$2 script=$3; shift 3
    local limit=${STEP_TIMEOUT:-240}
    [ "$name" = base ] && limit=${BASE_TIMEOUT:-300}  # a base before 0f2a763 compiles the Sinkhorn rounds: > 220 s
    mkdir -p $OUT/$name
    (cd /tmp && PYTHONPATH=$site timeout $limit python3 $script --compile --parity-tokens 0 \
        --out $OUT/$name "$@" > $OUT/$name/train_step.txt 2>&1; echo "$name exit $?")
    grep -E "^(dense|warmup|sparse) |kernel launches|sync trace|^  x" $OUT/$name/train_step.txt | sort -u
}
run base /tmp/site_base /tmp/base/benchmarks/train_step.py --phases ${BASE_PHASES:-sparse}
i=0
IFS=';' read -ra RUNS <<< "${HEAD_RUNS:-"--phases sparse --profile $OUT/head_0/prof --sync-trace;--phases dense,warmup"}"
for args in "${RUNS[@]}"; do
    run head_$i /tmp/site $REPO/benchmarks/train_step.py $args
    i=$((i + 1))
done
