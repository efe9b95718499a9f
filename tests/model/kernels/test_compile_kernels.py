"""compile_blocks over the Triton kernels (issue 17, levers "make --compile work" and "fewer graphs").

Traced by dynamo, the attention kernel failed on the GPU (a Python float ``scale`` typed fp64 made
Triton reject the loop-carried softmax maximum); as ``torch.compiler.disable``d functions, each
kernel entry point split its block's graph (71 graphs forward and 71 backward per benchmark step).
They are custom operators now (``torch.ops.v4launch.*``, their backwards too): a compiled block traces
them as opaque calls, keeps one graph around them, and dynamo never enters a kernel. Checked on the
CPU through Triton's interpreter (compile_cases.py, a subprocess): compiled and eager models give the
same loss and gradients, every kernel entry point is called, and no graph break names one. The
operators' schemas, shape functions and autograd registrations: ``torch.library.opcheck`` in
interpreter_cases.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


@pytest.mark.slow
def test_compiled_block_through_the_kernels_matches_eager():
    seed = random.randrange(2 ** 31)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_cases.py")), str(seed)],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, f"seed {seed}: compiled run failed:\n{proc.stderr[-4000:]}"
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("attention", "topk", "teacher", "student", "lse", "ce_grad"):
        assert r["eager_calls"].get(name) and r["compiled_calls"].get(name), f"seed {seed}: {name} not called: {r}"
    assert not r["breaks_at_kernels"], f"seed {seed}: graph breaks at kernel entry points: {r['breaks_at_kernels']}"
    assert abs(r["loss_compiled"] - r["loss"]) <= 1e-5 * abs(r["loss"]), f"seed {seed}: {r}"
    assert r["grad_rel"] <= 1e-5, f"seed {seed}: gradients differ: {r}"
