"""Query-block backward of the sparse sink attention's per-query ranges at 16 or 32 heads (SM90, bf16/fp16).

Where it applies: the per-query row *ranges* of a layer: all of its candidates in SWA (the window), HCA (the
window and every visible ratio-128 entry) and CSA in the dense phase (the window and every visible compressed
entry); the window beside the top-k index columns of CSA in the sparse phase, whose columns the single-pass
kernel then takes (``triton_attention.attention_bwd``). Dispatched by default (``triton_attention.QUERY_BLOCK_BACKWARD``;
timed per layer by ``benchmarks/attention_bwd_sweep_small_heads.py --query-blocks``). The top-k columns too can
run here, as a masked span (:func:`index_span`: range 1 = the span of a query's columns, a selection mask keeping
P = 0 on its other rows) where the span is short (``triton_attention.SPAN_PER_COLUMN``).

Why: at 16 heads the single-pass backward (``triton_attention._sparse_bwd``, one program per query) is bound by
its float32 dKV reductions: every query adds its own ``[rows, D]`` contribution with atomics, and at the
benchmark model's layers that is 25.8 ms of a 132.7 ms step (benchmarks/results/train_step_h200.md). Neighbouring
queries share almost all their range rows: the window moves by one row per query, the visible compressed entries
by at most one. So a program takes QB = 64 / H consecutive queries and treats them as one query of 64 "virtual
heads" (virtual row r = query r // H, head r % H): each kv tile of the block's *union* of ranges is gathered
once and its dKV reduced once for the whole block, with a [rows x virtual heads] mask keeping every query to its
own range. 64 virtual heads is the shape of the two-pass kernels' head block at V4-Flash's 64 heads
(``triton_attention_bwd``), whose two passes this follows (FlashAttention-2 backward, sec. 3.1):

Pass 1, ``_dkv_block_pass`` (one program = one block of QB queries): [q; dO] of the block stay resident as
NP column parts of [2 * 64, D / NP]; per union tile of BN kv rows

    [S^T | dP^T] = K_tile [q; dO]^T,   P^T = exp2(S^T * scale * log2e - lse * log2e)   (masked to each query's range)
    dS^T = P^T * (dP^T - delta) * scale,   dKV_tile = dS^T q + P^T dO                   (one reduction per block)

and each query's dS goes to its own slots of a [Tc, H, NC] buffer: range 0's rows at ``row - lo0``, range 1's
at ``CAP0 + row - lo1``.
Pass 2, dQ = dS K reading those slots back, in one of two forms (``CONFIG["dq_form"]``, for the sweep to pick):
``"query"``, ``_dq_range_pass`` (one program = one query, all H heads, over its own ranges), or ``"block"``,
``_dq_block_pass`` (one program = one block, 64 virtual heads, over the union tiles as pass 1: each kv tile
gathered once per block; the accumulator is [64, D] float32, as the two-pass pass 2 at 64 heads).

Slot capacity: the caller states the longest range 0 and range 1 any query has (``range_bounds``: the window and
the most visible compressed entries, both known on the host from the layer's plan), so the buffer's shape needs no
read of the ranges (none inside a captured CUDA graph). A range longer than its bound would write into the
next range's slots: ranges on the host are checked (ValueError); on the device, pass 1 asserts the bound in
Triton's debug mode (``TRITON_DEBUG=1``) only.
Memory: the dS buffer holds Tc queries, Tc = budget_bytes / (H * NC * itemsize); nothing in T^2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention_common import LOG2E, red_add_rows

VIRTUAL_HEADS = 64
"""Query rows per pass-1 program: QB = VIRTUAL_HEADS / H consecutive queries of H heads."""
CONFIG = dict(BN=128, NP=4, num_warps=8, num_stages=1, BNQ=64, dq_form="block", dq_warps=8, dq_stages=2)
"""Pass 1: BN kv rows per tile, [q; dO] in NP column parts; pass 2: BNQ kv rows per tile, per query or per
block (``dq_form``). The best of eight configs for the sparse step in the H200 sweep of 2026-12-03 with sparse
CSA's columns as a masked span (benchmarks/results/attention_bwd_query_blocks_h16_h200_2026-12-03_2aecd5d.txt):
11.8 ms less per sparse benchmark step and 15.3 ms less per dense one than the single pass, against 10.5 / 14.4 ms
for the earlier BN=64 per-query form (HCA and SWA layers are 0.06 ms slower at BN=128, CSA 0.4 ms faster)."""
BUDGET_BYTES = 2 << 30  # dS buffer per chunk of queries
UNION_END = tl.constexpr(2 ** 30)  # larger than any kv row: the start of an empty union


def supported(q: torch.Tensor) -> bool:
    """bf16 / fp16 q [T, H, D] with H in (16, 32) and D a multiple of 16 * NP (the kernels take ranges; index
    columns reach them only as a masked span, :func:`index_span`)."""
    H, D = q.shape[1], q.shape[2]
    return q.dtype in (torch.bfloat16, torch.float16) and H in (16, 32) and D % (16 * CONFIG["NP"]) == 0


@triton.jit
def _union(lo, hi):
    """(start, end) of the union's span of the block's non-empty ranges [lo, hi) (vectors over virtual rows);
    start > end when every one is empty."""
    some = hi > lo
    return tl.min(tl.where(some, lo, UNION_END), 0), tl.max(tl.where(some, hi, 0), 0)


@triton.jit
def _dkv_block_pass(Q, KV, RNG, O, DO, LSE, DELTA, DKV, DS, SEL, NC, CAP0, CAP1, SELW, t0, t_end, sq_t, sq_h,
                    qk_scale, sm_scale, H: tl.constexpr, D: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr,
                    NP: tl.constexpr, HAS_SEL: tl.constexpr, USE_ASM: tl.constexpr):
    """Program b: queries t0 + b * QB ... (those below t_end), virtual row r = (query r // H, head r % H).
    Q, O, DO share strides (sq_t, sq_h, 1); DKV float32 [N, D]; DS [Tc, H, NC] (query t's row t - t0);
    HAS_SEL: SEL uint8 [T, SELW], query t attends row lo1 + j of its range 1 only where SEL[t, j] != 0 (its
    other range-1 rows get P = 0, so dS = 0 in their slots and no dKV)."""
    R: tl.constexpr = QB * H
    P: tl.constexpr = D // NP
    first = t0 + tl.program_id(0) * QB
    offs_r = tl.arange(0, R)
    t_r = first + offs_r // H
    h_r = offs_r % H
    live = t_r < t_end
    offs_2r = tl.arange(0, 2 * R)
    t_2r = (first + (offs_2r % R) // H).to(tl.int64)
    live_2r = (t_2r < t_end)[:, None]
    from_q = offs_2r[:, None] < R
    offs_c = tl.arange(0, P)
    base = t_2r[:, None] * sq_t + ((offs_2r % R) % H)[:, None] * sq_h + offs_c[None, :]
    qdo = ()
    delta2 = tl.zeros([2 * R], tl.float32)  # rows R.. hold rowsum(dO * O); rows ..R stay 0
    for i in tl.static_range(NP):
        qdo_i = tl.load(tl.where(from_q, Q + base + i * P, DO + base + i * P), mask=live_2r, other=0.0)
        o_i = tl.load(O + base + i * P, mask=live_2r & ~from_q, other=0.0)
        delta2 += tl.sum(qdo_i.to(tl.float32) * o_i.to(tl.float32), 1)
        qdo = qdo + (qdo_i,)
    delta = tl.sum(tl.reshape(delta2, [2, R]), 0)
    row_th = t_r.to(tl.int64) * H + h_r
    tl.store(DELTA + row_th, delta, mask=live)
    lse2 = tl.load(LSE + row_th, mask=live, other=0.0) * 1.4426950408889634
    rng = RNG + t_r.to(tl.int64) * 4
    lo0 = tl.load(rng, mask=live, other=0)
    hi0 = tl.load(rng + 1, mask=live, other=0)
    lo1 = tl.load(rng + 2, mask=live, other=0)
    hi1 = tl.load(rng + 3, mask=live, other=0)
    tl.device_assert((hi0 - lo0 <= CAP0) & (hi1 - lo1 <= CAP1), "a range is longer than its stated bound")
    u_lo0, u_hi0 = _union(lo0, hi0)
    u_lo1, u_hi1 = _union(lo1, hi1)
    n0 = tl.cdiv(tl.maximum(u_hi0 - u_lo0, 0), BN)
    n1 = tl.cdiv(tl.maximum(u_hi1 - u_lo1, 0), BN)
    ds_row = (t_r - t0).to(tl.int64) * H + h_r
    offs_n = tl.arange(0, BN)
    for j in range(0, n0 + n1):  # the union tiles of range 0, then of range 1
        in0 = j < n0
        rows = tl.where(in0, u_lo0 + j * BN, u_lo1 + (j - n0) * BN) + offs_n
        in_union = rows < tl.where(in0, u_hi0, u_hi1)
        lo = tl.where(in0, lo0, lo1)
        own = (rows[:, None] >= lo[None, :]) & (rows[:, None] < tl.where(in0, hi0, hi1)[None, :]) & live[None, :]
        attended = own
        if HAS_SEL:  # range 1 is an index-column span: the rows between the columns are not attended
            in1 = tl.zeros([BN, R], tl.int32) + j >= n0  # a full-shape term: the interpreter refuses a scalar one
            chosen = tl.load(SEL + t_r.to(tl.int64)[None, :] * SELW + (rows[:, None] - lo[None, :]),
                             mask=own & in1, other=1)
            attended = own & (chosen != 0)
        kp = KV + rows.to(tl.int64)[:, None] * D + offs_c[None, :]
        sd = tl.zeros([BN, 2 * R], tl.float32)  # [S^T | dP^T]: one product with N = 2 * R
        for i in tl.static_range(NP):
            sd = tl.dot(tl.load(kp + i * P, mask=in_union[:, None], other=0.0), tl.trans(qdo[i]), sd)
        st, dpt = tl.split(tl.permute(tl.reshape(sd, [BN, 2, R]), (0, 2, 1)))
        pt = tl.where(attended, tl.math.exp2(st * qk_scale - lse2[None, :]), 0.0)
        dsb = (pt * (dpt - delta[None, :]) * sm_scale).to(Q.dtype.element_ty)
        slot = tl.where(in0, 0, CAP0) + rows[:, None] - lo[None, :]
        tl.store(DS + ds_row[None, :] * NC + slot, dsb, mask=own)
        # [dS^T | P^T] against the stacked [q; dO]: dKV = dS^T q + P^T dO for the whole block, reduced once
        a_op = tl.reshape(tl.permute(tl.join(dsb, pt.to(Q.dtype.element_ty)), (0, 2, 1)), [BN, 2 * R])
        for i in tl.static_range(NP):
            red_add_rows(DKV, rows, in_union, tl.dot(a_op, qdo[i]), i * P, D, USE_ASM)


@triton.jit
def _dq_range_pass(KV, RNG, DS, DQ, NC, CAP0, t0, sq_t, sq_h, H: tl.constexpr, D: tl.constexpr,
                   BNQ: tl.constexpr):
    """dQ[t] = dS[t] K over query t = t0 + program_id(0)'s own ranges (dS already carries the scale), reading
    the slots pass 1 wrote; slots past a range's end are read as 0."""
    t_loc = tl.program_id(0)
    t = t0 + t_loc.to(tl.int64)
    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BNQ)
    ds_base = DS + (t_loc * H + offs_h[:, None]).to(tl.int64) * NC
    acc = tl.zeros([H, D], tl.float32)
    for r in tl.static_range(2):
        lo = tl.load(RNG + t * 4 + 2 * r)
        hi = tl.load(RNG + t * 4 + 2 * r + 1)
        for start in range(lo, hi, BNQ):
            rows = start + offs_n
            valid = rows < hi
            kvt = tl.load(KV + rows.to(tl.int64)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
            ds = tl.load(ds_base + r * CAP0 + (start - lo) + offs_n[None, :], mask=valid[None, :], other=0.0)
            acc = tl.dot(ds, kvt, acc)
    tl.store(DQ + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :], acc.to(DQ.dtype.element_ty))


@triton.jit
def _dq_block_pass(KV, RNG, DS, DQ, NC, CAP0, t0, t_end, sq_t, sq_h, H: tl.constexpr, D: tl.constexpr,
                   QB: tl.constexpr, BNQ: tl.constexpr):
    """dQ of the block of queries t0 + program_id(0) * QB ... (those below t_end) over the union tiles of their
    ranges, as pass 1 walks them: virtual row r reads its query's slot of each row in its own range, 0 elsewhere."""
    R: tl.constexpr = QB * H
    first = t0 + tl.program_id(0) * QB
    offs_r = tl.arange(0, R)
    t_r = first + offs_r // H
    h_r = offs_r % H
    live = t_r < t_end
    rng = RNG + t_r.to(tl.int64) * 4
    ds_row = DS + ((t_r - t0).to(tl.int64) * H + h_r) * NC
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BNQ)
    acc = tl.zeros([R, D], tl.float32)
    for k in tl.static_range(2):
        lo = tl.load(rng + 2 * k, mask=live, other=0)
        hi = tl.load(rng + 2 * k + 1, mask=live, other=0)
        u_lo, u_hi = _union(lo, hi)
        for start in range(u_lo, u_hi, BNQ):
            rows = start + offs_n
            kvt = tl.load(KV + rows.to(tl.int64)[:, None] * D + offs_d[None, :], mask=(rows < u_hi)[:, None],
                          other=0.0)
            own = (rows[None, :] >= lo[:, None]) & (rows[None, :] < hi[:, None]) & live[:, None]
            ds = tl.load(ds_row[:, None] + k * CAP0 + rows[None, :] - lo[:, None], mask=own, other=0.0)
            acc = tl.dot(ds, kvt, acc)
    tl.store(DQ + t_r.to(tl.int64)[:, None] * sq_t + h_r[:, None] * sq_h + offs_d[None, :],
             acc.to(DQ.dtype.element_ty), mask=live[:, None])


def index_span(idx: torch.Tensor, ranges: torch.Tensor, span_bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index columns as a range 1 and a selection mask, for :func:`attention_bwd` (``selected``).

    Args:
        idx: [T, K] int kv rows, -1 = no column; the columns of one query are distinct.
        ranges: [T, 4] int with range 1 (columns 2, 3) empty: the index columns take its place.
        span_bound: the longest span (largest - smallest column + 1) of any query's columns, in rows.
    Returns:
        (ranges [T, 4] int32 whose range 1 is each query's span [smallest, largest + 1), empty without a column;
        selected uint8 [T, span_bound + 1]: 1 at (t, column - smallest) for each of query t's columns, 0
        elsewhere; the last column absorbs the -1 slots). All on idx's device, no host read (capturable).
    Raises: ValueError (CPU idx only: no device read) when a span is longer than ``span_bound``.
    The span's rows that are not columns keep P = 0, so the query-block backward over the span gives the
    columns' gradients exactly; it pays where the span is not much longer than K (sparse-phase CSA at short
    context: every visible entry of a segment of 4,096 tokens at ratio 4 is 1,024 rows against 512 columns).
    """
    valid = idx >= 0
    some = valid.any(1)
    lo = torch.where(valid, idx, torch.iinfo(idx.dtype).max).amin(1)
    hi = torch.where(valid, idx, -1).amax(1) + 1
    lo, hi = torch.where(some, lo, 0), torch.where(some, hi, 0)
    spans = torch.cat((ranges[:, :2].to(torch.int32), torch.stack((lo, hi), 1).to(torch.int32)), 1)
    selected = torch.zeros(idx.shape[0], span_bound + 1, dtype=torch.uint8, device=idx.device)
    if not idx.is_cuda and idx.numel() and int((hi - lo).max()) > span_bound:
        raise ValueError(f"span_bound={span_bound}: a query's index columns span {int((hi - lo).max())} rows; pass "
                         "the longest span (the most visible compressed entries)")
    # a span past the bound on the GPU: the scatter's index check stops the kernel (no silent wrong slot)
    selected.scatter_(1, torch.where(valid, idx - lo[:, None], span_bound).long(), 1)
    return spans, selected


def attention_bwd(q: torch.Tensor, kv: torch.Tensor, ranges: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, scale: float, range_bounds: tuple[int, int],
                  budget_bytes: int | None = None, dq_dtype: torch.dtype | None = None,
                  selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``triton_attention.sparse_sink_attention`` without index columns, in query blocks; with
    ``selected``, of index columns given as a span and a mask (:func:`index_span`).

    Args:
        q, out, dout: [T, H, D]; kv: [N, D]; ranges: [T, 4] int (``lo0, hi0, lo1, hi1``: kv rows
            ``[lo0, hi0)`` and ``[lo1, hi1)``, either may be empty); lse: [T, H] float32 from the forward.
        range_bounds: (the longest range 0, the longest range 1) over all queries, in rows: the window and
            the most visible compressed entries (``layer.attention_forward`` knows both on the host).
        budget_bytes: bound on the dS buffer (default ``BUDGET_BYTES``); queries run in chunks that fit it.
        dq_dtype: dq's dtype (default q's; float32 for a partial dQ another kernel adds to).
        selected: uint8 [T, >= range_bounds[1]] or None: query t attends row ``lo1 + j`` of its range 1 only
            where ``selected[t, j]`` is nonzero (:func:`index_span`).
    Returns:
        (dq [T, H, D] dq_dtype, dkv [N, D] float32, delta [T, H] float32 = rowsum(dout * out)): the same as
        ``triton_attention.attention_bwd_single_pass`` up to the order of the float32 additions.
    Raises:
        ValueError: :func:`supported` is false (dtype, heads, D), ``CONFIG["dq_form"]`` is
            neither "query" nor "block", a bound is negative, ``selected`` is not uint8 [T, >= range_bounds[1]],
            or
            (ranges on the host only: no device read here) a range is longer than its bound.
    """
    if not supported(q):
        raise ValueError(f"query-block backward needs bf16/fp16 q with 16 or 32 heads and D % "
                         f"{16 * CONFIG['NP']} == 0, got {q.dtype} {tuple(q.shape)}; use "
                         "triton_attention.attention_bwd_single_pass")
    if CONFIG["dq_form"] not in ("query", "block"):
        raise ValueError(f"CONFIG['dq_form']={CONFIG['dq_form']!r}: pass 2 runs per 'query' or per 'block'")
    if min(range_bounds) < 0:
        raise ValueError(f"range_bounds={range_bounds}: the longest ranges are row counts >= 0")
    if not ranges.is_cuda and ranges.numel():
        longest = tuple(int((ranges[:, 2 * r + 1] - ranges[:, 2 * r]).max()) for r in range(2))
        if any(n > b for n, b in zip(longest, range_bounds)):
            raise ValueError(f"range_bounds={tuple(range_bounds)}: the ranges are up to {longest} rows long; "
                             "pass the longest range 0 and range 1 (the window, the most visible entries)")
    if selected is not None and (selected.dtype != torch.uint8 or selected.dim() != 2
                                 or selected.shape[0] != q.shape[0] or selected.shape[1] < range_bounds[1]):
        raise ValueError(f"selected: {selected.dtype} {tuple(selected.shape)}; need uint8 [T={q.shape[0]}, "
                         f">= {range_bounds[1]}] (index_span builds it)")
    q, kv = q.contiguous(), kv.contiguous()
    T, H, D = q.shape
    QB, c = VIRTUAL_HEADS // H, CONFIG
    dout = dout.to(q.dtype).contiguous()
    out, lse, rng = out.contiguous(), lse.contiguous(), ranges.to(torch.int32).contiguous()
    dq = torch.empty_like(q, dtype=dq_dtype or q.dtype)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    delta = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, dkv, delta
    cap0, cap1 = (triton.cdiv(max(b, 1), c["BNQ"]) * c["BNQ"] for b in range_bounds)
    NC = cap0 + cap1
    Tc = max(QB, (budget_bytes or BUDGET_BYTES) // (H * NC * q.element_size()) // QB * QB)
    ds = torch.empty(min(Tc, triton.cdiv(T, QB) * QB), H, NC, dtype=q.dtype, device=q.device)
    for t0 in range(0, T, Tc):
        n = min(Tc, T - t0)
        _dkv_block_pass[(triton.cdiv(n, QB),)](
            q, kv, rng, out, dout, lse, delta, dkv, ds, rng if selected is None else selected, NC, cap0, cap1,
            0 if selected is None else selected.stride(0), t0, t0 + n, q.stride(0), q.stride(1),
            scale * LOG2E, scale, H=H, D=D, QB=QB, BN=c["BN"], NP=c["NP"], HAS_SEL=selected is not None,
            USE_ASM=q.is_cuda,
            num_warps=c["num_warps"], num_stages=c["num_stages"])
        if c["dq_form"] == "block":
            _dq_block_pass[(triton.cdiv(n, QB),)](kv, rng, ds, dq, NC, cap0, t0, t0 + n, q.stride(0), q.stride(1),
                                                  H=H, D=D, QB=QB, BNQ=c["BNQ"], num_warps=c["dq_warps"],
                                                  num_stages=c["dq_stages"])
        else:
            _dq_range_pass[(n,)](kv, rng, ds, dq, NC, cap0, t0, q.stride(0), q.stride(1), H=H, D=D, BNQ=c["BNQ"],
                                 num_warps=c["dq_warps"], num_stages=c["dq_stages"])
    return dq, dkv, delta
