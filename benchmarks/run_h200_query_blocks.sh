#!/usr/bin/env bash
# One-H200 batch for the query-block backward (model/kernels/triton_attention_query_blocks.py), in one call of
# under 600 s: its GPU tests (bf16 against float64, compiled at the shipped config), the per-layer sweep against
# the single-pass kernel (benchmarks/attention_bwd_sweep_small_heads.py --query-blocks), then the benchmark step
# in PHASE (default sparse; dense also routes its CSA layers) as three variants (train_step.py --compile
# --cuda-graph): 0 single_pass (--no-query-blocks), 1 query_blocks (sparse CSA's columns per query in the single
# pass: --span-per-column=0), 2 span_columns (the default: those columns as a masked span in query blocks too). The three parts may not fit one call together:
# PARTS="tests sweep", then PARTS=step (VARIANT_IDS="1 2" skips the single pass).
# Writes under $OUT: gpu_tests.txt, attention_bwd_query_blocks_h16.json and the sweep's table, and
# $PHASE_<variant>/train_step.{txt,json}. TESTS_TIMEOUT (120), SWEEP_TIMEOUT (120), STEP_TIMEOUT (200) bound
# the parts; PARTS (default "tests sweep step") picks them.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
PARTS=${PARTS:-"tests sweep step"}
if [[ " $PARTS " == *" tests "* ]]; then
    (cd /tmp && timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --rootdir=/tmp \
        $REPO/tests/model/kernels/test_kernels_triton.py -k query_block > $OUT/gpu_tests.txt 2>&1
     echo "query-block GPU tests exit $?"; tail -3 $OUT/gpu_tests.txt)
fi
if [[ " $PARTS " == *" sweep "* ]]; then
    (cd /tmp && timeout ${SWEEP_TIMEOUT:-120} python3 $REPO/benchmarks/attention_bwd_sweep_small_heads.py \
        --heads 16 --query-blocks --out $OUT > $OUT/attention_bwd_query_blocks_h16.txt 2>&1
     echo "sweep exit $?"; sed -n '/^attention backward, /,$p' $OUT/attention_bwd_query_blocks_h16.txt)
fi
if [[ " $PARTS " == *" step "* ]]; then
    names=(single_pass query_blocks span_columns)
    variants=("--no-query-blocks" "--span-per-column=0" "")
    for i in ${VARIANT_IDS:-0 1 2}; do
        variant=${variants[$i]}
        dir=$OUT/${PHASE:-sparse}_${names[$i]}
        mkdir -p $dir
        (cd /tmp && timeout ${STEP_TIMEOUT:-200} python3 $REPO/benchmarks/train_step.py --compile --cuda-graph \
            --phases ${PHASE:-sparse} --parity-tokens 0 --out $dir $variant > $dir/train_step.txt 2>&1
         echo "step ${names[$i]} exit $?")
        grep -E "^(dense|sparse) |peak measured" $dir/train_step.txt | sort -u
    done
fi
