#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: a virtual environment in .venv with the
# CPU build of torch (installed first, so nothing pulls a multi-GB CUDA build),
# then v4launch itself with its test extras; `--kernel-tests` adds Triton for the CPU runs of the
# fused kernels (tests/model/kernels/test_kernels_interpreter.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # The CPU wheel lies on CI machines' disk; elsewhere pip fetches the CPU build.
  .venv/bin/python -m pip install -q "torch==2.13.0" \
    || .venv/bin/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
.venv/bin/python -m pip install -q -e ".[test]"
if [ "${1:-}" = "--kernel-tests" ] && ! .venv/bin/python -c "import triton" >/dev/null 2>&1; then
  # Triton (~290 MB) only for its CPU interpreter, which the kernel tests run; a machine that
  # already has Triton (a GPU build of torch pins its own) keeps it.
  .venv/bin/python -m pip install -q -e ".[test,kernel-tests]"
fi
echo "set-up done: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
