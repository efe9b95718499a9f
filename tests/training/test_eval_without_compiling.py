"""The held-out evaluation runs compiled blocks eagerly (``step.without_compiling``): it compiles no no-grad
graphs (84 s at a stage end on an H200), and its loss is the eager model's."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from v4_helpers import build, fresh_gen, packed_batch, tiny_args  # noqa: E402

from v4launch.model.compile import compile_blocks  # noqa: E402
from v4launch.training.dist import DistInfo  # noqa: E402
from v4launch.training.step import evaluate  # noqa: E402


def test_evaluation_compiles_nothing_and_gives_the_eager_loss():
    gen = fresh_gen()
    model = build(tiny_args(), "sparse", gen, dtype=torch.float64)
    tokens, cu, max_seqlen, labels = packed_batch([40, 25, 31], model.args.vocab_size, gen)
    batch = SimpleNamespace(tokens=tokens, cu_seqlens=cu, max_seqlen=max_seqlen, labels=labels)
    info = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
    with torch.no_grad():
        eager = float(model(tokens, cu, max_seqlen, labels).lm_loss)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        assert compile_blocks(model, backend=counting_backend) > 0
        got = evaluate(model, [batch], info, contextlib.nullcontext)
        assert not graphs, f"evaluation compiled {len(graphs)} graphs"
        assert abs(got["lm_loss"] - eager) <= 1e-12 * abs(eager)
        with torch.no_grad():  # outside the evaluation the blocks do compile: the counter can see it
            model(tokens, cu, max_seqlen, labels)
        assert graphs
    finally:
        torch._dynamo.reset()
