"""compile.cuda_graph (training/graph_step.py) on a GPU: the captured step's losses and gradients equal the eager
step's, micro-batch after micro-batch of fresh random packings (other segment counts, other compressed-entry
counts: one graph for all), with gradient accumulation and a loss weight that changes between steps. With one
micro-batch per step the graph writes the gradients (no zeroing between steps: a replay that added would double
them); the stage's end drops them, and a gradient replaced after the capture stops the next replay.

GPU only (CUDA graphs); run by benchmarks/run_h200_tests.sh. The shapes a replay reuses are checked on the
CPU in tests/model/test_static_batch.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from v4_helpers import build, fresh_gen, packed_batch, tiny_args  # noqa: E402

from v4launch.training.graph_step import CapturedStep, CaptureError  # noqa: E402
from v4launch.training.step import LossWeights, accumulate  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

ROWS, SEQ = 2, 256


def _micro_batch(gen: torch.Generator, vocab: int) -> SimpleNamespace:
    lengths = []
    for _ in range(ROWS):
        left = SEQ
        while left:
            n = min(left, int(torch.randint(1, SEQ + 1, (1,), generator=gen)))
            lengths.append(n)
            left -= n
    tokens, cu, max_seqlen, labels = packed_batch(lengths, vocab, gen)
    return SimpleNamespace(tokens=tokens.cuda(), labels=labels.cuda(), cu_seqlens=cu, max_seqlen=max_seqlen,
                           num_real_tokens=tokens.numel())


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("phase,compiled,accum", [("dense", False, 2), ("dense", False, 1), ("sparse", False, 2),
                                                   ("sparse", True, 1), ("warmup", False, 1), ("warmup", True, 2)])
def test_replays_equal_the_eager_step(phase, compiled, accum):
    """float32 parameters under bf16 autocast (the job's precision; the float32 experts read their row counts on
    the host, rule V4-CUDA-GRAPH refuses them); ``compiled``: the blocks under torch.compile, captured with
    them (a block compiled again inside the capture fails it: the warm-up must have met every guard). ``warmup``:
    the dense KL through the Triton teacher and student on the static tables' row chunks (``layer.static_chunks``,
    no host read); both warm-up cases passed on an H100 on 2026-12-05, on which rule V4-CUDA-GRAPH lets the job
    capture warm-up stages. The compiled cases spend ~4 min compiling there (run_h200_tests.sh's
    PER_TEST_TIMEOUT=300 or more)."""
    gen = fresh_gen()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    # 16 heads of 32 and indexer heads of 32: shapes the Triton kernels take (others fall back to the reference);
    # top-k = every entry a row sees: the eager step's exact tables and the replay's static ones may order TIED
    # indexer scores differently (tests/model/test_static_batch.py TOPK)
    args = tiny_args(window_size=32, index_topk=SEQ // 4, n_heads=16, head_dim=32, index_n_heads=16, index_head_dim=32,
                     q_lora_rank=32, o_lora_rank=16, o_groups=4)
    model = build(args, phase, gen, dtype=torch.float32).cuda()
    model.set_kernel_backend("triton")
    if compiled:
        from v4launch.model.compile import compile_blocks

        torch._dynamo.reset()
        compile_blocks(model)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    captured = CapturedStep(model, seq_len=SEQ, accum=accum, autocast=autocast)
    tol = 2e-2  # bf16, and the Triton backward adds with atomics: the order differs run to run
    for step in range(3):
        batches = [_micro_batch(gen, args.vocab_size) for _ in range(accum)]
        weights = LossWeights(indexer_kl=0.01, balance=0.001, mtp=0.3 if step < 2 else 0.1)
        counts = [m.expert_counts.clone() for m in model.modules() if hasattr(m, "expert_counts")]
        model.zero_grad(set_to_none=False)  # in place: the graph captured these very tensors
        eager, _, _ = accumulate(model, batches, accum=accum, weights=weights, autocast=autocast)
        want = _grads(model)
        for m, c in zip([m for m in model.modules() if hasattr(m, "expert_counts")], counts):
            m.expert_counts.copy_(c)  # the eager pass counted its routing; the replay must count the same
        if not captured.writes_grads:  # else the eager gradients stay: the replay must overwrite, not add to them
            model.zero_grad(set_to_none=False)
        got, _, _ = accumulate(model, batches, accum=accum, weights=weights, autocast=autocast, captured=captured)
        assert captured.graph is not None and captured.writes_grads == (accum == 1)
        assert got.keys() == eager.keys()
        for name in eager:
            torch.testing.assert_close(got[name], eager[name], rtol=tol, atol=tol / 10, msg=lambda m: f"{name}: {m}")
        have = _grads(model)
        assert have.keys() == want.keys()
        for name in want:  # relative to the gradient's size: atomics reorder bf16-rounded additions
            err = float((have[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30))
            assert err < 5e-2 or float(want[name].norm()) < 1e-6, (name, err)
        flat_have, flat_want = (torch.cat([g[n].flatten() for n in sorted(want)]) for g in (have, want))
        assert float((flat_have - flat_want).norm() / flat_want.norm()) < 1e-2
        routed = [m.expert_counts for m in model.modules() if hasattr(m, "expert_counts")]
        assert all(int(r.sum()) == int(c.sum()) + accum * ROWS * SEQ * args.n_activated_experts
                   for r, c in zip(routed, counts) if r.numel())
    if accum == 1:  # a gradient dropped after the capture would go stale: the replay refuses
        name, param = next((n, p) for n, p in model.named_parameters() if p.grad is not None)
        param.grad = None
        with pytest.raises(CaptureError, match=name.replace(".", r"\.")):
            accumulate(model, batches, accum=accum, weights=weights, autocast=autocast, captured=captured)
    captured.release()  # the stage's end: the next stage's first backward starts from no gradient
    assert all(p.grad is None for p in model.parameters())
