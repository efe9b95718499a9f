"""Triton kernel (SM90): lightning-indexer scores, ``sum_h w[t,h] * relu(q[t,h] . k[c])``.

Tiles of [BT query rows x BC entries]; the head loop runs inside the program (64 matrix
products [BT x dI] x [dI x BC], ReLU and the head weight fused into the accumulator), so
no [T, H_I, C] tensor exists. Tiles wholly outside every row's visible range (causal
upper triangle, other segments) are written as -inf without any matrix work. The top-k
itself is ``torch.topk`` over each query chunk's score block (see ``reference.indexer_topk``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference

CONFIG = {"lp": dict(BT=64, BC=128, num_warps=4, num_stages=2),
          "fp32": dict(BT=32, BC=64, num_warps=4, num_stages=1)}


@triton.jit
def _index_scores(Q, W, KEYS, FIRST, NVIS, OUT, R, P, c_base, sq_t, sq_h, sw_t, so_r,
                  HI: tl.constexpr, DI: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    rows = pid_r * BT + tl.arange(0, BT)
    rmask = rows < R
    cols = pid_c * BC + tl.arange(0, BC)
    first = tl.load(FIRST + rows, mask=rmask, other=0) - c_base
    end = first + tl.load(NVIS + rows, mask=rmask, other=0)
    blk_lo = tl.min(tl.where(rmask, first, 2147483647), 0)
    blk_hi = tl.max(tl.where(rmask, end, 0), 0)
    acc = tl.zeros([BT, BC], tl.float32)
    c0 = pid_c * BC
    if (c0 < blk_hi) & (c0 + BC > blk_lo):
        offs_d = tl.arange(0, DI)
        kt = tl.load(KEYS + (c_base + cols).to(tl.int64)[None, :] * DI + offs_d[:, None],
                     mask=(cols < P)[None, :], other=0.0)  # [DI, BC]
        rows64 = rows.to(tl.int64)
        for h in range(HI):
            qh = tl.load(Q + rows64[:, None] * sq_t + h * sq_h + offs_d[None, :], mask=rmask[:, None], other=0.0)
            wh = tl.load(W + rows64 * sw_t + h, mask=rmask, other=0.0).to(tl.float32)
            s = tl.dot(qh, kt, input_precision=PREC)
            acc += tl.maximum(s, 0.0) * wh[:, None]
    ok = (cols[None, :] >= first[:, None]) & (cols[None, :] < end[:, None])
    out = tl.where(ok, acc, float("-inf"))
    tl.store(OUT + rows.to(tl.int64)[:, None] * so_r + cols[None, :], out, mask=rmask[:, None] & (cols < P)[None, :])


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, first: torch.Tensor,
                   n_visible: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Triton version of :func:`reference.indexer_scores` -> [R, hi - lo] float32."""
    q, w, keys = q.contiguous(), w.contiguous(), keys.contiguous().to(q.dtype)
    R, HI, DI = q.shape
    P = hi - lo
    out = torch.empty(R, P, dtype=torch.float32, device=q.device)
    if R == 0 or P == 0:
        return out
    cfg = CONFIG["fp32" if q.dtype == torch.float32 else "lp"]
    grid = (triton.cdiv(P, cfg["BC"]), triton.cdiv(R, cfg["BT"]))
    _index_scores[grid](q, w, keys, first.to(torch.int32).contiguous(), n_visible.to(torch.int32).contiguous(),
                        out, R, P, lo, q.stride(0), q.stride(1), w.stride(0), out.stride(0), HI=HI, DI=DI,
                        BT=cfg["BT"], BC=cfg["BC"], PREC="ieee" if q.dtype == torch.float32 else "tf32",
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


@torch.library.custom_op("v4launch::indexer_topk", mutates_args=())
def _topk_op(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, first: torch.Tensor, n_visible: torch.Tensor,
             topk: int, max_entries: int) -> torch.Tensor:
    return reference.indexer_topk(q, w, keys, first, n_visible, topk, max_entries, score_fn=indexer_scores)


@_topk_op.register_fake
def _topk_shapes(q, w, keys, first, n_visible, topk, max_entries):
    return q.new_empty((q.shape[0], min(topk, max_entries)), dtype=torch.int32)


def indexer_topk(q, w, keys, first, n_visible, topk: int, max_entries: int) -> torch.Tensor:
    """Triton-scored version of :func:`reference.indexer_topk` (same arguments and result, no gradient).
    A custom operator (``torch.ops.v4launch.indexer_topk``): a compiled caller keeps one graph around it;
    inside, the row ranges of a multi-chunk call are read on the host and the scores come from a Triton
    kernel, outside any trace."""
    return _topk_op(q.detach(), w.detach(), keys.detach(), first, n_visible, int(topk), int(max_entries))


def supported(q: torch.Tensor) -> bool:
    HI, DI = q.shape[1], q.shape[2]
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and DI >= 16 and DI & (DI - 1) == 0
