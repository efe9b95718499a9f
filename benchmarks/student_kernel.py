"""The sparse-phase KL student's Triton kernels alone, at the benchmark model's shape: time and error per variant.

    python benchmarks/student_kernel.py                     # 8,192 rows as 2 x 4,096, HI 16, dI 128, K 512
    python benchmarks/student_kernel.py --rows 4096 --seq 4096 --heads 64 --json $OUT/student.json

Why: the student backward was 17.8 ms of the compiled sparse step's ~155 ms of kernels on an H200 (four CSA
layers; benchmarks/results/train_step_h200.md). This times its forward and its backward with the two
gradient products as bf16 hi + lo pairs on the tensor cores (``split``, the default for bf16) or as float32
on the CUDA cores (``ieee``), the key gradient added by ``red.global.add.v2.f32`` or by ``tl.atomic_add``
(``ieee + atomic`` is the kernel before 2026-12-02), and states each one's error against float64 math on the
same bf16 inputs.

Selection: each row selects min(K, visible) compressed entries of its own sequence (compress ratio 4,
causal): all visible entries in order while they are fewer than K, else K of them at random. Neighbouring
rows then share most entries, as top-k selections do, so the key gradient's atomics collide as in training.
Timing: CUDA events, median of ``--iters`` after ``--warmup`` calls. Output: a table (ms per call and per
step of four CSA layers; relative Frobenius errors of dq, dw, d keys) and optionally JSON. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import cuda_time  # noqa: E402


def selection(rows: int, seq: int, k: int, ratio: int, device) -> torch.Tensor:
    """[rows, k] int32 entry ids (-1 = empty slot) of packed sequences of ``seq`` tokens, ``seq // ratio``
    compressed entries each, numbered across the batch; the rule in the module docstring."""
    per_seq = seq // ratio
    sel = torch.full((rows, k), -1, dtype=torch.int32)
    for t in range(rows):
        base, pos = (t // seq) * per_seq, t % seq
        nvis = (pos + 1) // ratio
        ids = torch.arange(nvis) if nvis <= k else torch.randperm(nvis)[:k].sort().values
        sel[t, :ids.numel()] = (base + ids).int()
    return sel.to(device)


def float64_truth(q, w, keys, sel, g):
    """The scores' gradients in float64 from the gathered keys (dq [T, HI, dI], dw [T, HI], d keys [C, dI])."""
    qd, wd, kd = (x.double().requires_grad_() for x in (q, w, keys))
    out = torch.zeros(sel.shape, dtype=torch.float64, device=q.device)
    ok = sel >= 0
    for lo in range(0, sel.shape[0], 1024):  # row chunks: the gathered keys are [rows, K, dI] float64
        s = sel[lo:lo + 1024].clamp_min(0).long()
        logits = torch.einsum("thd,tkd->thk", qd[lo:lo + 1024], kd[s]).relu()
        out = out.index_copy(0, torch.arange(lo, lo + s.shape[0], device=q.device),
                             torch.einsum("thk,th->tk", logits, wd[lo:lo + 1024]))
    return torch.autograd.grad((out * g.double() * ok).sum(), (qd, wd, kd))


def timed(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls (``attention.cuda_time``: CUDA events) after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return cuda_time(fn, iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16, help="indexer heads HI")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--ratio", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="CSA layers per step, for the per-step column")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    from v4launch.model.kernels import triton_student as ts

    dev = torch.device("cuda")
    torch.manual_seed(0)
    entries = (a.rows // a.seq) * (a.seq // a.ratio)
    q = torch.randn(a.rows, a.heads, a.head_dim, device=dev).to(torch.bfloat16)
    w = torch.randn(a.rows, a.heads, device=dev) * a.heads ** -0.5
    keys = torch.randn(entries, a.head_dim, device=dev).to(torch.bfloat16)
    sel = selection(a.rows, a.seq, a.topk, a.ratio, dev)
    g = torch.randn(a.rows, a.topk, device=dev) * 1e-3
    truth = float64_truth(q, w, keys, sel, g)

    def rel(x, y):
        return float((x.double() - y).norm() / y.norm())

    fwd_ms = timed(lambda: ts.student_scores(q, w, keys, sel), a.warmup, a.iters)
    rows = [dict(variant="forward", ms=fwd_ms, ms_per_step=fwd_ms * a.layers)]
    for name, split, red in (("bwd split+red.v2", True, True), ("bwd ieee+red.v2", False, True),
                             ("bwd ieee+atomic", False, False)):  # the last: the kernel before 2026-12-02
        def run():
            return ts.student_scores_backward(q, w, keys, sel, g, split=split, vector_red=red)
        ms = timed(run, a.warmup, a.iters)
        rows.append(dict(variant=name, ms=ms, ms_per_step=ms * a.layers,
                         **{f"rel_{n}": rel(x, t) for n, x, t in zip(("dq", "dw", "dkeys"), run(), truth)}))
    print(f"student kernels: rows {a.rows} (sequences of {a.seq}), HI {a.heads}, dI {a.head_dim}, K {a.topk}, "
          f"{entries} entries, {torch.cuda.get_device_name()}")
    print(f"{'variant':16s} {'ms/call':>8s} {'ms/step':>8s} {'rel dq':>9s} {'rel dw':>9s} {'rel dkeys':>9s}")
    for r in rows:
        errs = " ".join(f"{r[k]:9.2e}" if k in r else f"{'':9s}" for k in ("rel_dq", "rel_dw", "rel_dkeys"))
        print(f"{r['variant']:16s} {r['ms']:8.2f} {r['ms_per_step']:8.2f} {errs}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
