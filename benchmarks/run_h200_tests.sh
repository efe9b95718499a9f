#!/usr/bin/env bash
# The GPU tests on the device machine: the Triton / Gluon kernels against float64 and the reference
# (tests/model/kernels/test_kernels_triton.py) and the CUDA model tests (tests/model/test_cuda.py).
# Run from /tmp with --rootdir: from the repository root the checkout's v4launch/ directory would shadow the
# installed package (which maps model/ to v4launch.model) and the tests' imports fail.
# TESTS (default both files), K (a -k expression, spaces allowed: K="student or teacher") and PYTEST_ARGS (split
# on spaces, e.g. "-x") narrow it; output in $OUT/gpu_tests.txt. Verbose, with short tracebacks and the reasons of
# failures and errors in the summary: a run the outer timeout (TESTS_TIMEOUT, default 540 s) cuts off still names
# each test that finished and how; PER_TEST_TIMEOUT (default 300 s, pytest-timeout) fails one test that hangs
# with its traceback instead of losing the whole report.
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
R=$REPO
TESTS=${TESTS:-"tests/model/kernels/test_kernels_triton.py tests/model/test_cuda.py"}
(cd /tmp && timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -v -rfE --tb=short --timeout=${PER_TEST_TIMEOUT:-300} \
    -p no:cacheprovider --rootdir=/tmp --durations=5 \
    $(for t in $TESTS; do echo $R/$t; done) ${K:+-k "$K"} ${PYTEST_ARGS:-} > $OUT/gpu_tests.txt 2>&1; echo "gpu tests exit $?")
tail -15 $OUT/gpu_tests.txt
