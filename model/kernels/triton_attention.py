"""Triton kernels (SM90): sparse MQA attention with a sink, its backward, the KL teacher.

One program per query token (x ``n_split`` output slices): all H heads of the query
share the same K = V rows, so each selected row tile [BN, D] is loaded once and the
scores are an [H x BN] matrix product (heads are the M dimension). The softmax runs
online in base 2 with the sink as the initial running maximum (``m = sink``, ``l = 1``),
so a query with no valid candidate is well defined (out = 0, lse = sink).

Backward: bf16/fp16 with heads % 64 == 0 run the two-pass kernels of
``triton_attention_bwd`` (dKV with kv rows as the M dimension, then dQ from the stored dS).
The single-pass kernel here serves float32 and other head counts: per query, recompute p
from the saved lse, ``dS = p * (dP - delta)``; dQ accumulates in registers, dKV tiles
[BN, D] go to a float32 buffer with relaxed ``red.global.add.v2.f32`` reductions on column
pairs (``red_add_rows``, shared with the two-pass kernels; rows are shared across queries,
and V = K so both terms land in one row).
dsink = -sum_t exp(sink - lse) * delta (one tiny torch reduction).

Memory: O(T * H * D) for q/out/dq, O(N * D) float32 for dkv; nothing in T^2.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import triton_attention_bwd as two_pass
from . import triton_attention_query_blocks as query_blocks
from .triton_attention_common import LOG2E, prep_operands, red_add_rows

# Tuned on the H200 (see docs/kernels.md); keyed by "fwd"/"bwd"/"teacher" then dtype kind.
CONFIGS = {
    "fwd": {"lp": dict(BN=64, n_split=1, BH=64, num_warps=8, num_stages=2),
            "fp32": dict(BN=16, n_split=2, BH=16, num_warps=4, num_stages=1)},
    "bwd": {"lp": dict(BN=32, n_split=4, BH=64, num_warps=4, num_stages=1),
            # <= 16 heads: no output split (the scores are computed once per tile, not once per D slice);
            # 25.8 vs 45.9 ms per benchmark step (benchmarks/results/attention_bwd_sweep_h16_h200.md)
            "lp_h16": dict(BN=32, n_split=1, BH=16, num_warps=4, num_stages=1),
            "fp32": dict(BN=16, n_split=4, BH=16, num_warps=4, num_stages=1)},
    "teacher": {"lp": dict(BN=32, n_split=1, BH=64, num_warps=8, num_stages=2),
                "fp32": dict(BN=16, n_split=1, BH=16, num_warps=4, num_stages=1)},
}


def _kind(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "lp"


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def supported(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Shapes/dtypes these kernels handle: CUDA, bf16/fp16/fp32, H and D powers of two >= 16."""
    H, D = q.shape[1], q.shape[2]
    p2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and kv.dtype == q.dtype
            and p2(H) and p2(D) and H <= 128 and D <= 1024)


@triton.jit
def _fwd_tile(q, KV, rows, valid, m, l, acc, qk_scale, offs_d, dv0,
              D: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr):
    rows64 = rows.to(tl.int64)
    kvt = tl.load(KV + rows64[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(kvt), input_precision=PREC) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if DV == D:
        kvv = kvt
    else:
        offs_v = dv0 + tl.arange(0, DV)
        kvv = tl.load(KV + rows64[:, None] * D + offs_v[None, :], mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(kvv.dtype), kvv, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _sparse_fwd(Q, KV, IDX, RNG, SINK, O, LSE, LSE_SEL, K_SEL, sq_t, sq_h, so_t, so_h, qk_scale,
                H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr,
                HAS_IDX: tl.constexpr, HAS_RNG: tl.constexpr, PREC: tl.constexpr):
    """The selected slots go first, from an empty softmax state, so that after them (m, l) is the log-sum-exp
    over the selection alone (written to LSE_SEL: the KL teacher's normaliser); the sink and the ranges follow."""
    t = tl.program_id(0).to(tl.int64)
    dv0 = tl.program_id(1) * DV
    offs_h = tl.program_id(2) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    q = tl.load(Q + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :])
    sink = tl.load(SINK + offs_h).to(tl.float32) * 1.4426950408889634
    m = sink
    l = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, DV], tl.float32)
    if HAS_IDX:
        m = tl.full([BH], -1.0e30, tl.float32)
        l = tl.zeros([BH], tl.float32)
        for start in range(0, K_SEL, BN):
            sel = start + offs_n
            rows = tl.load(IDX + t * K_SEL + sel, mask=sel < K_SEL, other=-1)
            m, l, acc = _fwd_tile(q, KV, rows, rows >= 0, m, l, acc, qk_scale, offs_d, dv0, D, DV, PREC)
        if tl.program_id(1) == 0:
            tl.store(LSE_SEL + t * H + offs_h, (m + tl.math.log2(tl.maximum(l, 1e-30))) / 1.4426950408889634)
        m_new = tl.maximum(m, sink)  # then the sink, as one more logit
        alpha = tl.math.exp2(m - m_new)
        l = l * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m = m_new
    if HAS_RNG:
        for r in tl.static_range(2):
            lo = tl.load(RNG + t * 4 + 2 * r)
            hi = tl.load(RNG + t * 4 + 2 * r + 1)
            for start in range(lo, hi, BN):
                rows = start + offs_n
                m, l, acc = _fwd_tile(q, KV, rows, rows < hi, m, l, acc, qk_scale, offs_d, dv0, D, DV, PREC)
    out = acc / l[:, None]
    offs_v = dv0 + tl.arange(0, DV)
    tl.store(O + t * so_t + offs_h[:, None] * so_h + offs_v[None, :], out.to(O.dtype.element_ty))
    if tl.program_id(1) == 0:
        tl.store(LSE + t * H + offs_h, (m + tl.math.log2(l)) / 1.4426950408889634)


@triton.jit
def _bwd_tile(q, do, qv, dov, KV, DKV, rows, valid, lse2, delta, dq, qk_scale, sm_scale, offs_d, dv0,
              D: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr, USE_ASM: tl.constexpr):
    rows64 = rows.to(tl.int64)
    kvt = tl.load(KV + rows64[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(kvt), input_precision=PREC) * qk_scale
    p = tl.math.exp2(s - lse2[:, None])
    p = tl.where(valid[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(kvt), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    if DV == D:
        kvv = kvt
    else:
        offs_v = dv0 + tl.arange(0, DV)
        kvv = tl.load(KV + rows64[:, None] * D + offs_v[None, :], mask=valid[:, None], other=0.0)
    dq = tl.dot(ds.to(kvv.dtype), kvv, dq, input_precision=PREC)
    dkv = tl.dot(tl.trans(p.to(dov.dtype)), dov, input_precision=PREC)
    dkv = tl.dot(tl.trans((ds * sm_scale).to(qv.dtype)), qv, dkv, input_precision=PREC)
    red_add_rows(DKV, rows, valid, dkv, dv0, D, USE_ASM)
    return dq


@triton.jit
def _sparse_bwd(Q, KV, IDX, RNG, O, DO, LSE, DQ, DKV, DELTA, DQ_IN, K_SEL, sq_t, sq_h, qk_scale, sm_scale,
                H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr,
                HAS_IDX: tl.constexpr, HAS_RNG: tl.constexpr, PREC: tl.constexpr, USE_ASM: tl.constexpr,
                HAS_DQ_IN: tl.constexpr = False):
    """Q, O, DO, DQ (and DQ_IN, float32, added to dQ where HAS_DQ_IN) share the strides (sq_t, sq_h, 1); DKV is
    float32 [N, D]."""
    t = tl.program_id(0).to(tl.int64)
    dv0 = tl.program_id(1) * DV
    offs_h = tl.program_id(2) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, D)
    offs_v = dv0 + tl.arange(0, DV)
    offs_n = tl.arange(0, BN)
    base = t * sq_t + offs_h[:, None] * sq_h
    q = tl.load(Q + base + offs_d[None, :])
    do = tl.load(DO + base + offs_d[None, :])
    o = tl.load(O + base + offs_d[None, :])
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if DV == D:
        qv = q
        dov = do
    else:
        qv = tl.load(Q + base + offs_v[None, :])
        dov = tl.load(DO + base + offs_v[None, :])
    lse2 = tl.load(LSE + t * H + offs_h) * 1.4426950408889634
    dq = tl.zeros([BH, DV], tl.float32)
    if HAS_RNG:
        for r in tl.static_range(2):
            lo = tl.load(RNG + t * 4 + 2 * r)
            hi = tl.load(RNG + t * 4 + 2 * r + 1)
            for start in range(lo, hi, BN):
                rows = start + offs_n
                dq = _bwd_tile(q, do, qv, dov, KV, DKV, rows, rows < hi, lse2, delta, dq, qk_scale, sm_scale,
                               offs_d, dv0, D, DV, PREC, USE_ASM)
    if HAS_IDX:
        for start in range(0, K_SEL, BN):
            sel = start + offs_n
            rows = tl.load(IDX + t * K_SEL + sel, mask=sel < K_SEL, other=-1)
            dq = _bwd_tile(q, do, qv, dov, KV, DKV, rows, rows >= 0, lse2, delta, dq, qk_scale, sm_scale,
                           offs_d, dv0, D, DV, PREC, USE_ASM)
    dq = dq * sm_scale
    if HAS_DQ_IN:
        dq += tl.load(DQ_IN + base + offs_v[None, :])
    tl.store(DQ + base + offs_v[None, :], dq.to(DQ.dtype.element_ty))
    if tl.program_id(1) == 0:
        tl.store(DELTA + t * H + offs_h, delta)


@triton.jit
def _teacher_tile(q, KV, IDX, t, start, K_SEL, qk_scale, offs_n, offs_d,
                  D: tl.constexpr, PREC: tl.constexpr):
    """Scores [H, BN] (base 2, scaled) of query t against selected slots start..start+BN-1, the slot numbers
    and their validity (a slot past K_SEL or holding -1 is invalid)."""
    sel = start + offs_n
    rows = tl.load(IDX + t * K_SEL + sel, mask=sel < K_SEL, other=-1)
    valid = rows >= 0
    kvt = tl.load(KV + rows.to(tl.int64)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    return tl.dot(q, tl.trans(kvt), input_precision=PREC) * qk_scale, sel, valid


@triton.jit
def _teacher(Q, KV, IDX, LSE_SEL, OUT, K_SEL, sq_t, sq_h, qk_scale,
             H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, HAS_LSE: tl.constexpr):
    """HAS_LSE: the per-head log-sum-exp over the selection comes from the attention forward (LSE_SEL [T, H],
    natural log) and one pass over the gathered rows remains; else a first pass computes it."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    q = tl.load(Q + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :])
    if HAS_LSE:
        lse2 = tl.load(LSE_SEL + t * H + offs_h) * 1.4426950408889634
    else:
        m = tl.full([H], -1.0e30, tl.float32)
        l = tl.zeros([H], tl.float32)
        for start in range(0, K_SEL, BN):
            s, sel, valid = _teacher_tile(q, KV, IDX, t, start, K_SEL, qk_scale, offs_n, offs_d, D, PREC)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            l = l * tl.math.exp2(m - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), 1)
            m = m_new
        lse2 = m + tl.math.log2(tl.maximum(l, 1e-30))
    for start in range(0, K_SEL, BN):
        s, sel, valid = _teacher_tile(q, KV, IDX, t, start, K_SEL, qk_scale, offs_n, offs_d, D, PREC)
        p = tl.where(valid[None, :], tl.math.exp2(s - lse2[:, None]), 0.0)
        tl.store(OUT + t * K_SEL + sel, tl.sum(p, 0) / H, mask=sel < K_SEL)


def attention_fwd(q, kv, idx, sink, scale, ranges=None):
    """(out [T, H, D] like q, lse [T, H] float32) of :func:`sparse_sink_attention`, no autograd."""
    return _forward(q, kv, idx, sink, scale, ranges)[:2]


def _forward(q, kv, idx, sink, scale, ranges):
    """(out, lse, selected_lse [T, H] float32: the log-sum-exp over the valid selected slots alone, -1e30 for a
    row without one or without ``idx``)."""
    q, kv, idx_t, rng_t, has_idx, has_rng, K = prep_operands(q, kv, idx, ranges)
    T, H, D = q.shape
    cfg = CONFIGS["fwd"][_kind(q.dtype)]
    DV = D // cfg["n_split"]
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    lse_sel = torch.empty(T, H, dtype=torch.float32, device=q.device) if has_idx else lse.new_full((T, H), -1e30)
    if T:
        _sparse_fwd[(T, cfg["n_split"], H // min(cfg["BH"], H))](
            q, kv, idx_t, rng_t, sink.float().contiguous(), out, lse, lse_sel, K, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), scale * LOG2E, H=H, D=D, DV=DV, BN=cfg["BN"], BH=min(cfg["BH"], H),
            HAS_IDX=has_idx,
            HAS_RNG=has_rng, PREC=_prec(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse, lse_sel


QUERY_BLOCK_BACKWARD = True
"""Run range-only layers at 16 / 32 heads through ``triton_attention_query_blocks`` (where the caller states
``range_bounds``). On since timed on the H200 (2026-12-03, benchmarks/results/
attention_bwd_query_blocks_h16_h200_2026-12-03_799d8ff.txt): 3.8 ms less per sparse benchmark step and 14-15 ms
less per dense one than the single pass; ``benchmarks/train_step.py --no-query-blocks`` turns it off for an A/B."""

SPAN_PER_COLUMN = 2
"""Index columns run in query blocks as their span (:func:`triton_attention_query_blocks.index_span`) where the
caller's bound on a query's span is at most this many rows per column (0: never): the span's unselected rows
cost work (P = 0) but neighbouring queries share its kv tiles. Sparse-phase CSA of the benchmark model (1,024
visible entries per segment of 4,096 tokens, top-k 512: span bound 2 per column) took 2.44 ms per layer this
way against 4.53 ms with its 512 columns in the single pass (H200 sweep of 2026-12-03, benchmarks/results/
attention_bwd_query_blocks_h16_h200_2026-12-03_2aecd5d.txt); ``benchmarks/train_step.py --span-per-column 0``
turns it off for an A/B. Longer spans (long context: tens of thousands of entries against 512 columns) keep
the columns per query, in the single pass."""


def attention_bwd(q, kv, idx, ranges, out, lse, dout, scale, range_bounds=None):
    """(dq, dkv float32, delta) of :func:`sparse_sink_attention`: the two-pass kernels
    (``triton_attention_bwd``) where they apply and pay (bf16/fp16, heads % 64 == 0); with
    :data:`QUERY_BLOCK_BACKWARD` on, layers at 16 / 32 heads whose caller gave ``range_bounds``
    through the query-block kernels (``triton_attention_query_blocks``). With index columns, ``range_bounds[1]``
    bounds the span of a query's columns (largest - smallest + 1; range 1 must then be empty): a span of at most
    :data:`SPAN_PER_COLUMN` rows per column runs as a masked range in query blocks; otherwise (or with no span
    bound, 0) the ranges run in query blocks and the columns in the single pass, which adds the ranges' dQ.
    Else the single-pass kernel below
    (float32 parity runs, other head counts). At 16 heads the two-pass form runs (``head_block``) but
    measured 9% slower on the H200 at the benchmark model's layers, 28.2 vs 25.8 ms per step, both near the
    floor of their float32 dKV reductions (benchmarks/results/attention_bwd_two_pass_h16_h200.json), so it
    is not dispatched there."""
    if two_pass.supported(q) and q.shape[1] % two_pass.HEAD_BLOCK == 0:
        return two_pass.attention_bwd(q, kv, idx, ranges, out, lse, dout, scale)
    if QUERY_BLOCK_BACKWARD and range_bounds is not None and ranges is not None and query_blocks.supported(q):
        if idx is None or idx.shape[1] == 0:
            return query_blocks.attention_bwd(q, kv, ranges, out, lse, dout, scale, tuple(range_bounds))
        window, span = range_bounds
        if not ranges.is_cuda and bool((ranges[:, 3] > ranges[:, 2]).any()):
            raise ValueError("range_bounds beside index columns: range 1 must be empty (range_bounds[1] bounds the "
                             "columns' span); pass range_bounds=None for ranges and columns together")
        if 0 < span <= SPAN_PER_COLUMN * idx.shape[1]:  # the columns as a masked span, in query blocks
            spans, selected = query_blocks.index_span(idx, ranges, span)
            return query_blocks.attention_bwd(q, kv, spans, out, lse, dout, scale, (window, span), selected=selected)
        # the window in query blocks (the terms of P and dS over it use the whole row's lse and delta, so they are
        # exactly its share), the columns per query in the single pass
        dq_ranges, dkv, _ = query_blocks.attention_bwd(q, kv, ranges, out, lse, dout, scale, (window, 0),
                                                       dq_dtype=torch.float32)
        return attention_bwd_single_pass(q, kv, idx, None, out, lse, dout, scale, dq_in=dq_ranges, dkv_into=dkv)
    return attention_bwd_single_pass(q, kv, idx, ranges, out, lse, dout, scale)


def attention_bwd_single_pass(q, kv, idx, ranges, out, lse, dout, scale, dq_in=None, dkv_into=None):
    """One program per (query, output slice): recomputes the scores per slice; any dtype. ``dq_in`` (float32
    [T, H, D], optional): a partial dQ of other candidates, added to this one before the cast; ``dkv_into``
    (float32 [N, D], optional): the buffer the dKV reductions add into (returned), instead of a zeroed one."""
    q, kv, idx_t, rng_t, has_idx, has_rng, K = prep_operands(q, kv, idx, ranges)
    T, H, D = q.shape
    kind = _kind(q.dtype)
    cfg = CONFIGS["bwd"]["lp_h16" if kind == "lp" and H <= 16 else kind]
    DV = D // cfg["n_split"]
    dout = dout.to(q.dtype).contiguous()
    out = out.contiguous()
    dq = torch.empty_like(q)
    dkv = dkv_into if dkv_into is not None else torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    delta = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if dq_in is not None and (dq_in.dtype != torch.float32 or dq_in.shape != q.shape or not dq_in.is_contiguous()):
        raise ValueError(f"dq_in must be a contiguous float32 tensor of q's shape {tuple(q.shape)}, got "
                         f"{dq_in.dtype} {tuple(dq_in.shape)}")
    if T:
        _sparse_bwd[(T, cfg["n_split"], H // min(cfg["BH"], H))](
            q, kv, idx_t, rng_t, out, dout, lse.contiguous(), dq, dkv, delta, dq_in if dq_in is not None else dq, K,
            q.stride(0), q.stride(1), scale * LOG2E, scale, H=H, D=D, DV=DV, BN=cfg["BN"], BH=min(cfg["BH"], H),
            HAS_IDX=has_idx, HAS_RNG=has_rng, PREC=_prec(q.dtype), USE_ASM=q.is_cuda, HAS_DQ_IN=dq_in is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dq, dkv, delta


@torch.library.custom_op("v4launch::sparse_sink_attention", mutates_args=())
def _attention_op(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: Optional[torch.Tensor],
                  ranges: Optional[torch.Tensor], scale: float, range_bounds: Optional[list[int]] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, kv, idx, sink, scale, ranges)


@_attention_op.register_fake
def _attention_shapes(q, kv, sink, idx, ranges, scale, range_bounds=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:2], dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32))


@torch.library.custom_op("v4launch::sparse_sink_attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: Optional[torch.Tensor],
                           ranges: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                           scale: float, range_bounds: Optional[list[int]] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dkv, delta = attention_bwd(q, kv, idx, ranges, out, lse, dout, scale, range_bounds)
    dsink = -(torch.exp(sink.float()[None, :] - lse) * delta).sum(0)
    return dq, dkv.to(kv.dtype), dsink.to(sink.dtype)


@_attention_backward_op.register_fake
def _attention_backward_shapes(q, kv, sink, idx, ranges, out, lse, dout, scale, range_bounds=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(kv, memory_format=torch.contiguous_format), torch.empty_like(sink))


def _attention_save(ctx, inputs, output) -> None:
    q, kv, sink, idx, ranges, scale, range_bounds = inputs
    out, lse, selected_lse = output
    ctx.save_for_backward(q, kv, sink, idx, ranges, out, lse)
    ctx.scale, ctx.range_bounds = scale, range_bounds
    ctx.mark_non_differentiable(lse, selected_lse)


def _attention_grads(ctx, dout, _dlse, _dselected_lse):
    q, kv, sink, idx, ranges, out, lse = ctx.saved_tensors
    dq, dkv, dsink = _attention_backward_op(q, kv, sink, idx, ranges, out, lse, dout, ctx.scale, ctx.range_bounds)
    return dq, dkv, dsink, None, None, None, None


_attention_op.register_autograd(_attention_grads, setup_context=_attention_save)


def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, idx: Optional[torch.Tensor], sink: torch.Tensor,
                          scale: float, ranges: Optional[torch.Tensor] = None,
                          range_bounds: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`v4launch.model.kernels.reference.sparse_sink_attention`
    (same arguments and results; ``lse`` float32; gradients for q, kv, sink). ``range_bounds``: the longest
    range 0 and range 1 of any query, in rows (host ints: the window, the most visible compressed entries);
    beside index columns, range 1 being empty, the longest span of a query's columns instead. It lets the
    backward run in query blocks (:data:`QUERY_BLOCK_BACKWARD`, :func:`attention_bwd`); None: unknown.

    A custom operator (``torch.ops.v4launch.sparse_sink_attention``, its backward another): a compiled
    caller (a block of ``compile.compile_blocks``) keeps one graph around it and calls the operator,
    which launches the kernels as written (dynamo never traces into them: traced, it had typed the Python
    float ``scale`` as fp64 inside the kernel, and Triton refused the loop-carried softmax maximum)."""
    return _attention_op(q, kv, sink, idx, ranges, float(scale), _bounds(range_bounds))[:2]


def sparse_sink_attention_with_selected_lse(q: torch.Tensor, kv: torch.Tensor, idx: Optional[torch.Tensor],
                                            sink: torch.Tensor, scale: float, ranges: Optional[torch.Tensor] = None,
                                            range_bounds: Optional[tuple[int, int]] = None
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sparse_sink_attention` plus ``selected_lse`` [T, H] float32 (no gradient): each head's log-sum-exp
    of ``scale * q.kv`` over the valid slots of ``idx`` alone (no sink, no ranges; -1e30 where a row has none),
    which the forward kernel has on the way (it visits the selection first). :func:`head_avg_probs` given it
    gathers the selected rows once instead of twice."""
    return _attention_op(q, kv, sink, idx, ranges, float(scale), _bounds(range_bounds))


def _bounds(range_bounds: Optional[tuple[int, int]]) -> Optional[list[int]]:
    """The operator's form of ``range_bounds``: a list of two Python ints, or None."""
    return None if range_bounds is None else [int(b) for b in range_bounds]


@torch.library.custom_op("v4launch::head_avg_probs", mutates_args=())
def _teacher_op(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float,
                selected_lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    q, kv = q.contiguous(), kv.contiguous()
    T, H, D = q.shape
    K = idx.shape[1]
    out = torch.empty(T, K, dtype=torch.float32, device=q.device)
    has_lse = selected_lse is not None
    lse_t = selected_lse.float().contiguous() if has_lse else out.new_zeros(1)
    if T and K:
        cfg = CONFIGS["teacher"][_kind(q.dtype)]
        _teacher[(T,)](q, kv, idx.to(torch.int32).contiguous(), lse_t, out, K, q.stride(0), q.stride(1),
                       scale * LOG2E, H=H, D=D, BN=cfg["BN"], PREC=_prec(q.dtype), HAS_LSE=has_lse,
                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


@_teacher_op.register_fake
def _teacher_shapes(q, kv, idx, scale, selected_lse=None):
    return q.new_empty((q.shape[0], idx.shape[1]), dtype=torch.float32)


def head_avg_probs(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float,
                   selected_lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton version of :func:`v4launch.model.kernels.reference.head_avg_probs` -> [T, K] float32, no gradient
    (the KL teacher): per-head log-sum-exp over the selection, then the head-averaged probabilities. Given
    ``selected_lse`` [T, H] (from :func:`sparse_sink_attention_with_selected_lse` on the same q, kv, idx and
    scale) the first of those two passes over the gathered rows is skipped. A custom operator
    (``torch.ops.v4launch.head_avg_probs``), as :func:`sparse_sink_attention`."""
    lse = None if selected_lse is None else selected_lse.detach()
    return _teacher_op(q.detach(), kv.detach(), idx, float(scale), lse)
