"""Triton kernel (SM90): the warm-up KL teacher over every visible entry, read as a contiguous range.

The warm-up (dense) KL's teacher is the sparse phase's (:func:`triton_attention.head_avg_probs`) with the
selection "every entry the query sees" (seed 000 §3: the indexer learns the main attention's head-averaged
distribution over all visible compressed entries). Those entries are one contiguous run of ``kv_all`` rows per
query, ``lo[t] .. lo[t] + n[t] - 1``, so this kernel reads them by range (no [rows, entries] int32 selection
table to build and read back), and it forms the two passes differently from the sparse teacher:

* pass 1, each head's log-sum-exp: scores [H, BN] = q [H, D] . k^T (heads are the M dimension), the online
  maximum and sum reduce along N, inside a warp;
* pass 2, the head-averaged probabilities: scores^T [BT, H] = k [BT, D] . q^T (entries are the M dimension), so
  the average over heads reduces along N, inside a warp, where the sparse teacher's [H, BN] form reduced across
  the warps of the M dimension through shared memory for every tile (measured: benchmarks/teacher_kernel.py).

Rows later in a segment see more entries; programs run the longest rows first (``T - 1 - pid``) so the grid's
tail is short rows. Slots ``n[t] .. W - 1`` of a row are written 0, as the sparse teacher writes masked slots.

Memory: the output [T, W] float32 only. Base-2 exponentials with ``scale * log2(e)`` folded into the scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

CONFIG = dict(BN=64, BT=64, TRANSPOSED=True, LONGEST_FIRST=True, num_warps=4, num_stages=2)
"""Tile sizes and launch settings for bf16 / fp16. On the H200 at Flash width (benchmarks/teacher_kernel.py,
4,096 rows of a 64K-token segment, 2026-12-04; benchmarks/results/teacher_kernel_h200_2026-12-04.json): 13.14 ms
for the middle chunk (355 TFLOP/s) where the sparse teacher over a table took 33.22 ms (141); 8 warps 16.37 ms,
1 stage 17.28 ms, heads as pass 2's M dimension 14.49 ms."""


@triton.jit
def _dense_teacher(Q, KV, LO, NV, OUT, T, W, sq_t, sq_h, qk_scale,
                   H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
                   TRANSPOSED: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    if LONGEST_FIRST:
        pid = T - 1 - pid
    t = pid.to(tl.int64)
    lo = tl.load(LO + t).to(tl.int64)
    n = tl.load(NV + t)
    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    offs_t = tl.arange(0, BT)
    q = tl.load(Q + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :])  # [H, D]
    m = tl.full([H], -1.0e30, tl.float32)
    l = tl.zeros([H], tl.float32)
    for start in range(0, n, BN):
        j = start + offs_n
        valid = j < n
        k = tl.load(KV + (lo + j)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [H, BN]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        l = l * tl.math.exp2(m - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), 1)
        m = m_new
    lse2 = m + tl.math.log2(tl.maximum(l, 1e-30))  # [H], base 2
    if TRANSPOSED:
        qt = tl.trans(q)  # [D, H]
        for start in range(0, n, BT):
            j = start + offs_t
            valid = j < n
            k = tl.load(KV + (lo + j)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(k, qt) * qk_scale  # [BT, H]
            p = tl.where(valid[:, None], tl.math.exp2(s - lse2[None, :]), 0.0)
            tl.store(OUT + t * W + j, tl.sum(p, 1) / H, mask=j < W)
    else:
        for start in range(0, n, BT):
            j = start + offs_t
            valid = j < n
            k = tl.load(KV + (lo + j)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [H, BT]
            p = tl.where(valid[None, :], tl.math.exp2(s - lse2[:, None]), 0.0)
            tl.store(OUT + t * W + j, tl.sum(p, 0) / H, mask=j < W)
    zeros = tl.zeros([BT], tl.float32)
    for start in range(tl.cdiv(n, BT) * BT, W, BT):
        j = start + offs_t
        tl.store(OUT + t * W + j, zeros, mask=j < W)


def supported(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Shapes/dtypes this kernel handles: CUDA, bf16/fp16 (float32's [H, D] query does not fit in shared memory
    at Flash width), H and D powers of two with 16 <= H <= 128, 16 <= D <= 1024."""
    H, D = q.shape[1], q.shape[2]
    p2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
            and p2(H) and p2(D) and H <= 128 and D <= 1024)


@torch.library.custom_op("v4launch::dense_head_avg_probs", mutates_args=())
def _dense_teacher_op(q: torch.Tensor, kv: torch.Tensor, lo: torch.Tensor, n_visible: torch.Tensor, width: int,
                      scale: float) -> torch.Tensor:
    q, kv = q.contiguous(), kv.contiguous()
    T, H, D = q.shape
    out = torch.empty(T, width, dtype=torch.float32, device=q.device)
    if T and width:
        c = CONFIG
        _dense_teacher[(T,)](q, kv, lo.to(torch.int32).contiguous(), n_visible.to(torch.int32).contiguous(), out,
                             T, width, q.stride(0), q.stride(1), scale * LOG2E, H=H, D=D, BN=c["BN"], BT=c["BT"],
                             TRANSPOSED=c["TRANSPOSED"], LONGEST_FIRST=c["LONGEST_FIRST"],
                             num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out


@_dense_teacher_op.register_fake
def _dense_teacher_shapes(q, kv, lo, n_visible, width, scale):
    return q.new_empty((q.shape[0], width), dtype=torch.float32)


def dense_head_avg_probs(q: torch.Tensor, kv: torch.Tensor, lo: torch.Tensor, n_visible: torch.Tensor, width: int,
                         scale: float) -> torch.Tensor:
    """The warm-up KL teacher: q [T, H, D], kv [N, D] (bf16 / fp16, same dtype), query t's entries the kv rows
    ``lo[t] .. lo[t] + n_visible[t] - 1`` (lo, n_visible [T] integer, n_visible <= width) -> [T, width] float32,
    no gradient: slot j of row t is the softmax over those entries of ``scale * q[t, h] . kv[lo[t] + j]``,
    averaged over the H heads, for j < n_visible[t], and 0 after. Equals
    ``reference.head_avg_probs(q, kv, idx, scale)`` with ``idx[t, j] = lo[t] + j`` (-1 past ``n_visible[t]``).
    A custom operator (``torch.ops.v4launch.dense_head_avg_probs``). Raises nothing itself: the caller keeps
    ``lo[t] + n_visible[t] <= N`` (``layer._DenseKL`` passes each query's visible entries, inside ``kv``); use
    :func:`supported` to choose it."""
    return _dense_teacher_op(q.detach(), kv.detach(), lo, n_visible, int(width), float(scale))
