"""The fused Triton kernels on CPU, through Triton's interpreter, against float64 references.

The interpreter executes the kernels' own code (tile walks over window ranges and index columns,
the two-pass backward's slot layout and query chunks, masks, the float32 dKV reductions) on
numpy, so every CPU run checks their logic; compilation, speed and bf16 stay with the GPU tests
(test_kernels_triton.py). The cases run in one subprocess (interpreter_cases.py), because
``TRITON_INTERPRET=1`` must be set before the kernels are defined. Needs Triton
(``scripts/setup.sh --kernel-tests``); skipped without it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

triton = pytest.importorskip("triton")


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


if _version(triton.__version__) < (3, 9) and _version(numpy.__version__) >= (2, 4):
    pytest.skip(f"Triton {triton.__version__}'s interpreter cannot use numpy {numpy.__version__} scalars "
                "as indices (fixed in Triton 3.9)", allow_module_level=True)

CASES = [f"{kind}/{mode}" for mode in ("idx+ranges", "idx", "ranges")
         for kind in ("single_pass", "two_pass", "two_pass_h16")]
CASES += [f"query_blocks_h{H}/{kind}" for H in (16, 32) for kind in ("generic", "window")] + ["query_blocks_dispatch"]
CASES += [f"query_blocks_span_h{H}" for H in (16, 32)]
CASES += ["teacher", "dense_teacher", "indexer_scores", "student", "student_h32", "cross_entropy", "sinkhorn", "opcheck"]
TOL = 1e-5  # float32 kernels against float64 truth; measured 1e-7 .. 5e-7


@pytest.fixture(scope="module")
def interpreter_results():
    seed = random.randrange(2 ** 31)  # fresh inputs every run; the seed is in any failure message
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("interpreter_cases.py")), str(seed)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"seed {seed}: interpreter run failed:\n{proc.stderr[-4000:]}"
    return seed, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_float64_under_interpreter(case, interpreter_results):
    seed, results = interpreter_results
    errors = results[case]
    assert errors, f"seed {seed}: case {case} measured nothing"
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"seed {seed}: {case} {worst} relative error {errors[worst]:.2e} > {TOL:.0e}"


def test_two_pass_backward_refuses_an_unknown_pass_name():
    """The benchmark-only ``passes`` argument names passes; a typo must not silently skip one."""
    import torch

    from v4launch.model.kernels import triton_attention_bwd as tb

    q = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="passes=.*'dkv'.*'dq'"):
        tb.attention_bwd(q, q[:, 0], None, None, q, torch.zeros(2, 64), q, 1.0, passes=("dkv", "dQ"))



def test_student_kernels_refuse_queries_and_keys_of_two_dtypes():
    """Promoted, bf16 queries beside float32 keys ran the student as float32 products on the CUDA cores (~24x
    slower, unnoticed for a CSA first layer); now the kernels refuse them and name the fix."""
    import torch

    from v4launch.model.kernels import triton_student as ts

    q, w = torch.zeros(4, 16, 16, dtype=torch.bfloat16), torch.zeros(4, 16)
    keys, sel = torch.zeros(8, 16), torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q is torch.bfloat16 and keys torch.float32.*cast the keys"):
        ts.student_scores(q, w, keys, sel)
    with pytest.raises(ValueError, match="one dtype"):
        ts.student_scores_backward(q, w, keys, sel, torch.zeros(4, 2))
