"""compile_blocks over the Triton kernels, run by Triton's CPU interpreter; prints one JSON object.

Started by test_compile_kernels.py in a subprocess (``TRITON_INTERPRET=1`` must be set before the
kernels are defined). Usage: ``python compile_cases.py SEED``. One CSA layer with an indexer in
the sparse phase, float32, so the compiled block calls all three kernel entry points
(``sparse_sink_attention`` forward and backward, ``indexer_topk``, ``head_avg_probs``). The eager
model is the truth; the compiled one must give the same loss and gradients, dynamo must not have
traced into a kernel (it would fail inside the interpreter, as it failed on the GPU), and no graph
break may name a kernel entry point (they are custom operators, called from inside the graph).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from v4_helpers import build, packed_batch, tiny_args  # noqa: E402
from v4launch.model import model as model_module  # noqa: E402
from v4launch.model.compile import compile_blocks  # noqa: E402
from v4launch.model.kernels import dispatch  # noqa: E402
from v4launch.model.kernels import triton_attention as ta  # noqa: E402
from v4launch.model.kernels import triton_cross_entropy as tce  # noqa: E402
from v4launch.model.kernels import triton_indexer as ti  # noqa: E402
from v4launch.model.kernels import triton_student as ts  # noqa: E402

CALLS: dict[str, int] = {}


def counted(name: str, fn):
    def call(*args):
        CALLS[name] = CALLS.get(name, 0) + 1
        return fn(*args)
    return call


def loss_and_grads(model, batch):
    out = model(*batch)
    loss = out.lm_loss + sum(out.aux_losses.values())
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)]


def main(seed: int) -> dict:
    # the Triton entry points themselves (their CUDA checks would route CPU tensors to the reference code)
    backend = dispatch.Backend("triton", "triton", "Triton interpreter",
                               counted("attention", ta.sparse_sink_attention_with_selected_lse),
                               counted("topk", ti.indexer_topk),
                               counted("teacher", ta.head_avg_probs), counted("student", ts.student_scores),
                               counted("lse", tce.logsumexp_target), counted("ce_grad", tce.softmax_grad))
    model_module.select_backend = lambda name, device: backend
    gen = torch.Generator().manual_seed(seed)
    args = tiny_args(n_layers=1, n_mtp_layers=0, compress_ratios=(4,), n_hash_layers=0, n_heads=16, head_dim=32,
                     rope_head_dim=8, index_n_heads=4, index_head_dim=16, index_topk=3)
    model = build(args, "sparse", gen, dtype=torch.float32, kernel_backend="triton")
    batch = packed_batch([23, 13], args.vocab_size, gen)
    loss, grads = loss_and_grads(model, batch)
    eager_calls = dict(CALLS)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, backend="aot_eager")
    loss_c, grads_c = loss_and_grads(model, batch)
    entry_points = ("sparse_sink_attention", "indexer_topk", "head_avg_probs", "student_scores")
    breaks = [reason.split("\n")[1].strip() if "\n" in reason else reason
              for reason in counters["graph_break"] if any(name in reason for name in entry_points)]
    num = sum(float((a - b).double().square().sum()) for a, b in zip(grads_c, grads))
    den = sum(float(b.double().square().sum()) for b in grads)
    return dict(loss=float(loss), loss_compiled=float(loss_c), grad_rel=(num / max(den, 1e-30)) ** 0.5,
                eager_calls=eager_calls, compiled_calls={k: CALLS[k] - eager_calls.get(k, 0) for k in CALLS},
                breaks_at_kernels=breaks, graphs=counters["stats"]["unique_graphs"])


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
