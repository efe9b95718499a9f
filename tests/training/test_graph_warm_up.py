"""compile.cuda_graph with compiled blocks: nothing may compile inside the capture (inductor's passes run kernels and
synchronise, which fails a capture with a CUDA error naming no cause). The warm-up passes must meet every guard
the capture's pass meets. Checked on the CPU with dynamo (``aot_eager``), the capture stood in for by
``graph_step.no_compiling`` (dynamo's fail_on_recompile stance, which the capture runs under).

Found on an H200 (benchmarks/results/train_step_h200.md, 2026-12-02): the first block was traced before the
matmul capability probe had run, so dynamo guarded on the probe cache being empty; the capture, the first pass
after the probe with empty RoPE tables, matched no compiled entry and compiled inside the capture.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from v4_helpers import build, fresh_gen, packed_batch, tiny_args  # noqa: E402

from v4launch.model import matmul  # noqa: E402
from v4launch.training.graph_step import CapturedStep, no_compiling  # noqa: E402


def test_a_region_traced_before_the_matmul_probe_is_not_compiled_again_after_it(monkeypatch):
    monkeypatch.setattr(matmul, "_PROBED", {})  # no probe has run in this process
    torch._dynamo.reset()

    def region(x):
        return x * 2 if matmul._works(matmul._probe_mm, x.device) else x + 1

    compiled = torch.compile(region, backend="eager")
    x = torch.randn(5, generator=fresh_gen())
    first = compiled(x)
    matmul._works(matmul._probe_mm, x.device)  # an eager first use elsewhere probes
    assert matmul._PROBED, "the eager call should have probed"
    with no_compiling():  # as inside a capture: a second compile of the region raises
        again = compiled(x)
    # traced code answers without the probe: CUDA builds have the wide GEMM, other devices take the upcast path
    torch.testing.assert_close(first, x + 1, rtol=0, atol=0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_no_compiling_refuses_a_compile():
    """The stand-in must be able to fail: a region never compiled raises under it."""
    torch._dynamo.reset()
    fresh = torch.compile(lambda x: x - 3, backend="eager")
    with no_compiling(), pytest.raises(RuntimeError, match="recompile"):
        fresh(torch.ones(2))


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["dense", "sparse"])
def test_the_capture_pass_compiles_nothing_after_the_warm_up(phase):
    """The captured step's warm-up, then its pass as the capture runs it (RoPE tables cleared, under
    fail_on_recompile), on compiled blocks under bf16 autocast: no compile, and the losses of the warm-up."""
    gen = fresh_gen()
    seq = 128
    args = tiny_args(window_size=32, index_topk=seq // 4)
    model = build(args, phase, gen, dtype=torch.float32)
    from v4launch.model.compile import compile_blocks

    torch._dynamo.reset()
    compile_blocks(model, backend="aot_eager")
    step = CapturedStep(model, seq_len=seq, accum=1, warmup=2,
                        autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    tokens, cu, max_seqlen, labels = packed_batch([40, 88, seq], args.vocab_size, gen)
    step.ctx = model.batch_context(tokens, cu, max_seqlen, labels, static_seqlen=seq)
    step.tokens, step.labels = tokens, labels
    weight = {"mtp": 0.3}.get
    step._warm_up(lambda name: weight(name, 0.01))
    step.ctx._rope.clear()
    with no_compiling():
        captured = step._forward_backward(lambda name: weight(name, 0.01))
    assert step.ctx._rope, "the capture's pass builds the RoPE tables itself"
    step.ctx._rope.clear()
    with torch.compiler.set_stance("force_eager"):  # the same pass without the compiled code
        eager = step._forward_backward(lambda name: weight(name, 0.01))
    assert set(captured) == set(eager) and "lm_loss" in captured
    for name, value in captured.items():
        torch.testing.assert_close(value, eager[name], rtol=2e-2, atol=1e-3, msg=name)  # bf16 autocast
