"""Pass 1 of the two-pass sparse-attention backward in Gluon (SM90): dKV and dS with whole-line
dKV reductions. ``triton_attention_bwd.attention_bwd`` runs it on an H100/H200 for D = 512 (the V4
head size) with the Triton release it was tested with, and the Triton pass 1 elsewhere
(``triton_attention_bwd.gluon_pass1_unavailable`` says why).

Same math, tiles and dS slot layout as ``triton_attention_bwd._dkv_pass``: one program = one query t
and one head block of BH = 64; the BN = 128 kv rows of a candidate tile are the wgmma M dimension;
V = K, so one product gives dKV = dS^T q + P^T dO (the equations are in that module's docstring;
FlashAttention-2 backward, sec. 3.1). What this kernel does that plain Triton cannot express:

* **whole-line reductions.** Every tile adds dKV [BN, D] float32 into random rows of the dKV buffer
  with ``red.global.add.v2.f32``. From the wgmma accumulator layout one warp instruction touches
  eight rows x 32 bytes (eight cache lines), and the H200 sustains 565 G additions/s that way
  against 940 G/s when each instruction covers whole 128-byte lines (one CTA per SM, 8 warps,
  ``benchmarks/reduction_layout.py``): the rate is set by lines per instruction, not by warps or
  CTAs. Two butterfly exchanges between lanes (``shfl.sync.bfly``, ``line_exchange.py``)
  turn each instruction into two rows x one whole line, in registers, without shared memory;
* asynchronous wgmma with explicit waits: per column part i of D the loop issues
  dKV_i(j) = [dS^T | P^T](j) [q_i; dO_i], then [S^T | dP^T](j + 1) += K_i(j + 1) [q_i; dO_i]^T,
  and reduces part i while tile j + 1's score product is in flight;
* kv rows gathered into shared memory with ``cp.async``, NBUF - 1 parts ahead;
* one N = 2 BH product for the scores (q and dO stacked in shared memory), dS stored coalesced.

Measured on the H200, CSA-shaped 64K problem, pass 1 alone (``benchmarks/results/attention_h200.md``):
43.6 ms against 48.7 for the Triton pass 1 and 49.9 for this kernel with reductions from the
accumulator layout; the exchanges cost 8 ms, the reductions then add 7.5 ms instead of 22.

Shared memory at H = 64, D = 512, bf16, NP = 8, NBUF = 4: [q; dO] 128 KB + kv parts 64 KB.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .line_exchange import line_exchange_red_asm

# Measured on the H200: D in NP column parts of BH = 64, NBUF kv-part buffers. The kv tile BN = 128
# is triton_attention_bwd.CONFIGS['dkv']['BN'] (it fixes the dS slot layout pass 2 reads).
CONFIG = dict(NP=8, NBUF=4, num_warps=8)


@gluon.jit
def _tile_rows(j, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, BN: gl.constexpr, HAS_IDX: gl.constexpr,
               layout: gl.constexpr):
    """kv rows [BN] (in ``layout``) and validity of candidate tile j of query t, the order of
    ``triton_attention_bwd._tile_rows``: range 0's tiles, range 1's, then the index columns.
    Invalid rows (past a range, masked index, j >= n_tiles) point at row 0 so a gather stays in
    bounds."""
    offs_n = gl.arange(0, BN, layout=layout)
    in0 = j < n0
    in1 = (j >= n0) & (j < n0 + n1)
    start = gl.where(in0, lo0 + j * BN, gl.where(in1, lo1 + (j - n0) * BN, (j - n0 - n1) * BN))
    rows = start + offs_n
    valid = rows < gl.where(in0, hi0, hi1)
    if HAS_IDX:
        is_idx = j >= n0 + n1
        sel = gl.load(IDX + t * K_SEL + rows, mask=rows < gl.where(is_idx & (j < n_tiles), K_SEL, 0), other=-1)
        valid = gl.where(is_idx, sel >= 0, valid)
        rows = gl.where(is_idx, sel, rows)
    valid = valid & (j < n_tiles)
    return gl.where(valid, rows, 0), valid


@gluon.jit
def _gather_part(k_s, slot: gl.constexpr, KV, rows, part: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
                 layout: gl.constexpr):
    """cp.async of columns part * P ... of kv rows ``rows`` into buffer ``slot``, one commit group."""
    offs_c = gl.arange(0, P, layout=gl.SliceLayout(0, layout))
    cp.async_copy_global_to_shared(k_s.index(slot), KV + rows.to(gl.int64)[:, None] * D + (part * P + offs_c)[None, :])
    cp.commit_group()


LINE_RED_ASM = gl.constexpr(line_exchange_red_asm(512))
LINE_RED_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 32 + ["l"] * 32 + ["r"] * 32 + ["r"] * 32))


@gluon.jit
def _red_add_rows_lines(OUT, rows, valid, vals, col0, D: gl.constexpr):
    """``OUT[rows[r], col0 + c] += vals[r, c]`` (float32, relaxed, gpu scope) for valid rows.
    vals [BN, 64] float32 in the m64n64 wgmma accumulator layout (instr [16, 64, 16], warps [W, 1]),
    rows / valid [BN] in its row slice; D must be 512 (the address arithmetic is in the PTX).
    Lanes exchange values first so each ``red.global.add.v2.f32`` covers whole 128-byte lines
    (``line_exchange.line_exchange_red_asm``)."""
    gl.static_assert(D == 512)
    r = gl.where(valid, rows, -1)
    base = (OUT + col0).to(gl.int64, bitcast=True) + gl.zeros_like(vals).to(gl.int64)
    r, v = gl.broadcast(r[:, None], vals)
    gl.inline_asm_elementwise(asm=LINE_RED_ASM, constraints=LINE_RED_CONSTRAINTS, args=[base, r, v],
                              dtype=gl.int32, is_pure=False, pack=32)


@gluon.jit
def _scores_to_operands(sd, j, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, t_loc, K_SEL, DS, NC, hb, lse2_s, delta_s,
                        qk_scale, sm_scale, H: gl.constexpr, BN: gl.constexpr, BH: gl.constexpr,
                        HAS_IDX: gl.constexpr, REDUCE_IDX: gl.constexpr, mma: gl.constexpr, op: gl.constexpr,
                        NO_RED: gl.constexpr):
    """Tile j from its [S^T | dP^T] [BN, 2 BH]: P^T = exp2(S^T log2e scale - lse log2e),
    dS^T = P^T (dP^T - delta) scale. Stores dS (coalesced along the slots) and returns the [dS^T],
    [P^T] wgmma register operands with the tile's rows and the validity its dKV reductions use."""
    s, dp = gl.split(gl.permute(gl.reshape(sd, [BN, 2, BH]), (0, 2, 1)))
    s = gl.convert_layout(s, mma)
    dp = gl.convert_layout(dp, mma)
    rows, valid = _tile_rows(j, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, BN, HAS_IDX,
                             gl.SliceLayout(1, mma))
    lse2 = lse2_s.load(gl.SliceLayout(0, mma))
    delta = delta_s.load(gl.SliceLayout(0, mma))
    pt = gl.exp2(s * qk_scale - lse2[None, :])
    pt = gl.where(valid[:, None], pt, 0.0)
    dsb = (pt * (dp - delta[None, :]) * sm_scale).to(DS.dtype.element_ty)
    st: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, gl.num_warps()], [0, 1])
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, st))
    offs_h = hb + gl.arange(0, BH, layout=gl.SliceLayout(0, st))
    gl.store(DS + (t_loc * H + offs_h[None, :]).to(gl.int64) * NC + (j * BN + offs_n)[:, None],
             gl.convert_layout(dsb, st))
    if not REDUCE_IDX:
        valid = valid & (j < n0 + n1)
    if NO_RED:
        valid = valid & (NC < 0)
    return (gl.convert_layout(dsb, op), gl.convert_layout(pt.to(DS.dtype.element_ty), op), rows, valid)


@gluon.jit
def _dkv_pass(Q, KV, IDX, RNG, O, DO, LSE, DELTA, DKV, DS, K_SEL, NC, t0, sq_t, sq_h, qk_scale, sm_scale,
              H: gl.constexpr, D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NP: gl.constexpr,
              NBUF: gl.constexpr, HAS_IDX: gl.constexpr, HAS_RNG: gl.constexpr, REDUCE_IDX: gl.constexpr = True,
              NO_RED: gl.constexpr = False):
    """Arguments and outputs as ``triton_attention_bwd._dkv_pass`` (program (i, j): query t0 + i,
    heads j * BH ...): dKV [N, D] float32 += this query's contributions, dS [Tc, H, NC] and
    delta [T, H] written. REDUCE_IDX = False skips the index tiles' reductions and NO_RED = True all
    of them (wrong gradients: for ``benchmarks/attention.py --bwd-breakdown`` only). Needs
    D / NP == BH == 64 (the dKV parts share the score accumulators' layout), D == 512 and
    NP % NBUF == 0."""
    gl.static_assert(D // NP == BH)
    gl.static_assert(BH == 64)
    gl.static_assert(NP % NBUF == 0)
    P: gl.constexpr = D // NP
    NW: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = Q.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BH, 16])
    mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                   instr_shape=[16, 2 * BH, 16])
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // P, P // 8], [NW, 1], [1, 0])
    qdo_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BH, P], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, P], dtype)
    qdo_s = gl.allocate_shared_memory(dtype, [NP, 2 * BH, P], qdo_sl)  # part i: rows 0..BH-1 q, BH.. dO
    k_s = gl.allocate_shared_memory(dtype, [NBUF, BN, P], kv_sl)

    t_loc = gl.program_id(0)
    t = t0 + t_loc.to(gl.int64)
    hb = gl.program_id(1) * BH
    # q and dO into shared memory; delta = rowsum(dO * O)
    offs_hl = hb + gl.arange(0, BH, layout=gl.SliceLayout(1, ld))
    offs_cl = gl.arange(0, P, layout=gl.SliceLayout(0, ld))
    base = t * sq_t + offs_hl[:, None] * sq_h + offs_cl[None, :]
    delta_l = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, ld))
    for i in gl.static_range(NP):
        qdo_s.index(i).slice(0, BH).store(gl.load(Q + base + i * P))
        do_part = gl.load(DO + base + i * P)
        qdo_s.index(i).slice(BH, BH).store(do_part)
        delta_l += gl.sum(do_part.to(gl.float32) * gl.load(O + base + i * P).to(gl.float32), 1)
    gl.store(DELTA + t * H + offs_hl, delta_l)
    # lse * log2e and delta wait in shared memory (read once per tile; registers are the limit here)
    row_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    delta_s = gl.allocate_shared_memory(gl.float32, [BH], row_sl, gl.convert_layout(delta_l, gl.SliceLayout(0, mma)))
    lse2_s = gl.allocate_shared_memory(gl.float32, [BH], row_sl, gl.load(
        LSE + t * H + hb + gl.arange(0, BH, layout=gl.SliceLayout(0, mma))) * 1.4426950408889634)

    lo0 = 0
    hi0 = 0
    lo1 = 0
    hi1 = 0
    if HAS_RNG:
        lo0 = gl.load(RNG + t * 4)
        hi0 = gl.load(RNG + t * 4 + 1)
        lo1 = gl.load(RNG + t * 4 + 2)
        hi1 = gl.load(RNG + t * 4 + 3)
    n0 = gl.cdiv(gl.maximum(hi0 - lo0, 0), BN)
    n1 = gl.cdiv(gl.maximum(hi1 - lo1, 0), BN)
    n_tiles = n0 + n1
    if HAS_IDX:
        n_tiles += gl.cdiv(K_SEL, BN)
    n_tiles = gl.maximum(n_tiles, 1)

    # kv-part stream: copy c = part c % NP of tile c // NP into buffer c % NBUF, issued NBUF - 1 ahead
    rows_a, _ = _tile_rows(0, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, BN, HAS_IDX, gl.SliceLayout(1, ld))
    rows_b, _ = _tile_rows(1, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, BN, HAS_IDX, gl.SliceLayout(1, ld))
    for c0 in gl.static_range(NBUF - 1):
        _gather_part(k_s, c0 % NBUF, KV, rows_a, c0, D, P, ld)
    fence_async_shared()
    gl.thread_barrier()

    # tile 0's scores
    sd = gl.zeros([BN, 2 * BH], gl.float32, layout=mma2)
    for i in gl.static_range(NP):
        cp.wait_group(NBUF - 2)
        fence_async_shared()
        gl.thread_barrier()
        sd = warpgroup_mma(k_s.index(i % NBUF), qdo_s.index(i).permute((1, 0)), sd, use_acc=i > 0, is_async=True)
        sd = warpgroup_mma_wait(0, deps=(sd, ))
        if i + NBUF - 1 < NP:
            _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_a, i + NBUF - 1, D, P, ld)
        else:
            _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_b, i + NBUF - 1 - NP, D, P, ld)
    dsb, ptb, rows, valid = _scores_to_operands(sd, 0, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, t_loc, K_SEL,
                                                DS, NC, hb, lse2_s, delta_s, qk_scale, sm_scale, H, BN, BH, HAS_IDX,
                                                REDUCE_IDX, mma, op, NO_RED)

    # tile j's dKV under tile j + 1's scores
    for j in range(0, n_tiles - 1):
        rows_a = rows_b
        rows_b, _ = _tile_rows(j + 2, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, BN, HAS_IDX,
                               gl.SliceLayout(1, ld))
        for i in gl.static_range(NP):
            dkv = warpgroup_mma(dsb, qdo_s.index(i).slice(0, BH), gl.zeros([BN, P], gl.float32, layout=mma),
                                use_acc=False, is_async=True)
            dkv = warpgroup_mma(ptb, qdo_s.index(i).slice(BH, BH), dkv, is_async=True)
            cp.wait_group(NBUF - 2)
            fence_async_shared()
            gl.thread_barrier()
            sd = warpgroup_mma(k_s.index(i % NBUF), qdo_s.index(i).permute((1, 0)), sd, use_acc=i > 0, is_async=True)
            dkv = warpgroup_mma_wait(1, deps=(dkv, ))  # tile j + 1's part-i scores stay in flight
            _red_add_rows_lines(DKV, rows, valid, dkv, i * P, D)
            if i + NBUF - 1 < NP:
                _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_a, i + NBUF - 1, D, P, ld)
            else:
                _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_b, i + NBUF - 1 - NP, D, P, ld)
        sd = warpgroup_mma_wait(0, deps=(sd, ))
        dsb, ptb, rows, valid = _scores_to_operands(sd, j + 1, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, t_loc,
                                                    K_SEL, DS, NC, hb, lse2_s, delta_s, qk_scale, sm_scale, H, BN,
                                                    BH, HAS_IDX, REDUCE_IDX, mma, op, NO_RED)
    # the last tile's dKV
    for i in gl.static_range(NP):
        dkv = warpgroup_mma(dsb, qdo_s.index(i).slice(0, BH), gl.zeros([BN, P], gl.float32, layout=mma),
                            use_acc=False, is_async=True)
        dkv = warpgroup_mma(ptb, qdo_s.index(i).slice(BH, BH), dkv, is_async=True)
        dkv = warpgroup_mma_wait(0, deps=(dkv, ))
        _red_add_rows_lines(DKV, rows, valid, dkv, i * P, D)
    cp.wait_group(0)

