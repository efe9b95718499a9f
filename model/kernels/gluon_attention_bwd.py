"""Pass 1 of the two-pass sparse-attention backward in Gluon (SM90): an experiment in overlapping
the dKV reductions with the tensor-core products. Selected with
``triton_attention_bwd.attention_bwd(..., dkv_kernel="gluon")``; not the default.

Same math, tiles and dS slot layout as ``triton_attention_bwd._dkv_pass`` (one program = one
query t and one head block of BH = 64; the BN = 128 kv rows of a candidate tile are the wgmma M
dimension; V = K so one product gives dKV = dS^T q + P^T dO). What plain Triton cannot express
and this kernel does:

* asynchronous wgmma with explicit waits: per column part i of D the loop issues
  dKV_i(j) = [dS^T | P^T](j) [q_i; dO_i], then [S^T | dP^T](j + 1) += K_i(j + 1) [q_i; dO_i]^T,
  and issues part i's ``red.global.add.v2.f32`` while tile j + 1's products are in flight
  (DKV_BUF = 2: part i - 1's reductions under part i's products);
* kv rows gathered into shared memory with ``cp.async``, NBUF - 1 parts ahead;
* one N = 2 BH product for the scores (q and dO stacked in shared memory), dS stored coalesced.

Measured on the H200 at 64K CSA tokens (``benchmarks/results/attention_h200.md``): 49.7 ms against
the Triton pass 1's 48.9; without any reductions 27.5 ms. The 22 ms of reductions stay additive:
the products in flight while a part's reductions drain are about a quarter of the drain time, so
the same warps still wait. Hiding them needs reducer warps of their own (warp specialisation).

Shared memory at H = 64, D = 512, bf16, NP = 8, NBUF = 4: [q; dO] 128 KB + kv parts 64 KB.

``_dkv_pass_ws`` takes the next step: reducer warps of their own (``gl.warp_specialize``). The default
partition (8 warps) stages each dKV part (or half part, SPLIT = 2) in shared memory and signals an
mbarrier; a 4-warp partition copies it to registers, frees the stage and issues the ``red``s with
whole-sector rows. Measured at 64K (launch with maxnreg=168): 52.1 ms at best (SPLIT = 2, NBUF = 4,
RED_REGS = 72), 36.4 ms with the reductions predicated off. The reductions now add 15.7 ms instead of
22, but the default partition, limited to 216 registers and a one-deep 16 KB stage (the 227 KB of
shared memory hold [q; dO], four kv parts and one half-part stage), is 9 ms slower than the
single-partition kernel without reductions (27.5 ms).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

# Best measured configuration: BN kv rows per tile, D in NP column parts, NBUF kv-part buffers.
CONFIG = dict(BN=128, NP=8, NBUF=4, num_warps=8)


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


@gluon.jit
def _red_add_rows(OUT, rows, valid, vals, col0, D: gl.constexpr, layout: gl.constexpr):
    """``OUT[rows[r], col0 + c] += vals[r, c]`` (float32, relaxed, gpu scope) for valid rows; vals in
    the wgmma accumulator ``layout``, whose adjacent register pairs are adjacent columns, so each
    pair is one ``red.global.add.v2.f32``. The address is base-of-row + column offset inside the asm:
    no tensor of 64-bit pointers."""
    C: gl.constexpr = vals.shape[1]
    base = (OUT + rows.to(gl.int64) * D + col0).to(gl.int64, bitcast=True)
    col = gl.arange(0, C, layout=gl.SliceLayout(0, layout)) * 4
    base, col = gl.broadcast(base[:, None], col[None, :])
    ok, col = gl.broadcast(valid.to(gl.int32)[:, None], col)
    gl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        .reg .u64 a;
        setp.ne.b32 p, $4, 0;
        cvt.u64.u32 a, $6;
        add.u64 a, a, $2;
        @p red.global.gpu.relaxed.add.v2.f32 [a], {$8, $9};
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        }""",
        constraints="=r,=r,l,l,r,r,r,r,r,r", args=[base, ok, col, vals], dtype=gl.int32, is_pure=False, pack=2)


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
              DKV_BUF: gl.constexpr = 1, NO_RED: gl.constexpr = False):
    """Arguments and outputs as ``triton_attention_bwd._dkv_pass`` (program (i, j): query t0 + i,
    heads j * BH ...). NO_RED = True predicates every reduction off (wrong result: timing only). Needs D / NP == BH (the dKV parts share the score accumulators' layout) and
    NP % NBUF == 0."""
    gl.static_assert(D // NP == BH)
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
        dkv_prev = dsb  # placeholder; with DKV_BUF == 2 part i - 1 is reduced under part i's products
        for i in gl.static_range(NP):
            dkv = warpgroup_mma(dsb, qdo_s.index(i).slice(0, BH), gl.zeros([BN, P], gl.float32, layout=mma),
                                use_acc=False, is_async=True)
            dkv = warpgroup_mma(ptb, qdo_s.index(i).slice(BH, BH), dkv, is_async=True)
            cp.wait_group(NBUF - 2)
            fence_async_shared()
            gl.thread_barrier()
            sd = warpgroup_mma(k_s.index(i % NBUF), qdo_s.index(i).permute((1, 0)), sd, use_acc=i > 0, is_async=True)
            if DKV_BUF == 2:
                if i > 0:
                    dkv_prev = warpgroup_mma_wait(3, deps=(dkv_prev, ))
                    _red_add_rows(DKV, rows, valid, dkv_prev, (i - 1) * P, D, mma)
                dkv_prev = dkv
            else:
                dkv = warpgroup_mma_wait(1, deps=(dkv, ))  # tile j + 1's part-i scores stay in flight
                _red_add_rows(DKV, rows, valid, dkv, i * P, D, mma)
            if i + NBUF - 1 < NP:
                _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_a, i + NBUF - 1, D, P, ld)
            else:
                _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_b, i + NBUF - 1 - NP, D, P, ld)
        if DKV_BUF == 2:
            dkv_prev, sd = warpgroup_mma_wait(0, deps=(dkv_prev, sd))
            _red_add_rows(DKV, rows, valid, dkv_prev, (NP - 1) * P, D, mma)
        else:
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
        _red_add_rows(DKV, rows, valid, dkv, i * P, D, mma)
    cp.wait_group(0)


@gluon.jit
def _reducer(DKV, stage_s, rows_s, full_b, empty_b, n_items, D: gl.constexpr, NP: gl.constexpr,
             RED_OFF: gl.constexpr, SPLIT: gl.constexpr):
    """Worker partition: takes each staged dKV part [BN, P] (float32) and its rows (-1 = skip) out of
    shared memory, frees the stage, then adds it to DKV with ``red`` (one warp per row, coalesced)."""
    NSTAGE: gl.constexpr = stage_s.shape[0]
    P: gl.constexpr = stage_s.shape[2]
    # 8 threads x 2 floats = 64 contiguous bytes of a row per red.v2 instruction group: whole L2 sectors
    red_l: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [gl.num_warps(), 1], [1, 0])
    for it in range(n_items):
        s = it % NSTAGE
        mbarrier.wait(full_b.index(s), (it // NSTAGE) & 1)
        vals = stage_s.index(s).load(red_l)
        rows = rows_s.index(s).load(gl.SliceLayout(1, red_l))
        mbarrier.arrive(empty_b.index(s), count=1)
        ok = rows >= 0
        if RED_OFF:
            ok = ok & (n_items < 0)
        _red_add_rows(DKV, rows, ok, vals, (it // SPLIT % NP) * (P * SPLIT) + (it % SPLIT) * P, D, red_l)


@gluon.jit
def _stage_part(dkv, rows, valid, it, stage_s, rows_s, full_b, empty_b, XBAR: gl.constexpr):
    """Consumer side: dKV part ``it`` to the reducer, whole or as SPLIT column pieces (the stage
    holds [BN, P / SPLIT])."""
    SPLIT: gl.constexpr = dkv.shape[1] // stage_s.shape[2]
    if SPLIT == 1:
        _stage_piece(dkv, rows, valid, it, stage_s, rows_s, full_b, empty_b, XBAR)
    else:
        BN: gl.constexpr = dkv.shape[0]
        lo, hi = gl.split(gl.permute(gl.reshape(dkv, [BN, 2, dkv.shape[1] // 2]), (0, 2, 1)))
        _stage_piece(lo, rows, valid, 2 * it, stage_s, rows_s, full_b, empty_b, XBAR)
        _stage_piece(hi, rows, valid, 2 * it + 1, stage_s, rows_s, full_b, empty_b, XBAR)


@gluon.jit
def _stage_piece(dkv, rows, valid, it, stage_s, rows_s, full_b, empty_b, XBAR: gl.constexpr):
    """Wait for a free stage, write one piece and its rows, signal the reducer."""
    NSTAGE: gl.constexpr = stage_s.shape[0]
    s = it % NSTAGE
    mbarrier.wait(empty_b.index(s), ((it // NSTAGE) & 1) ^ 1)
    stage_s.index(s).store(dkv)
    rows_s.index(s).store(gl.where(valid, rows, -1))
    if XBAR:
        gl.thread_barrier()
    mbarrier.arrive(full_b.index(s), count=1)


@gluon.jit
def _consumer(Q, KV, IDX, RNG, O, DO, LSE, DELTA, DS, K_SEL, NC, t0, sq_t, sq_h, qk_scale, sm_scale,
              n_tiles, n0, n1, lo0, hi0, lo1, hi1, qdo_s, k_s, stage_s, rows_s, full_b, empty_b,
              H: gl.constexpr, D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NP: gl.constexpr,
              NBUF: gl.constexpr, HAS_IDX: gl.constexpr, REDUCE_IDX: gl.constexpr, XBAR: gl.constexpr):
    """Default partition: everything of pass 1 except the reductions (staged for ``_reducer``)."""
    P: gl.constexpr = D // NP
    NW: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = Q.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BH, 16])
    mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                   instr_shape=[16, 2 * BH, 16])
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // P, P // 8], [NW, 1], [1, 0])
    t_loc = gl.program_id(0)
    t = t0 + t_loc.to(gl.int64)
    hb = gl.program_id(1) * BH
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
    row_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    delta_s = gl.allocate_shared_memory(gl.float32, [BH], row_sl, gl.convert_layout(delta_l, gl.SliceLayout(0, mma)))
    lse2_s = gl.allocate_shared_memory(gl.float32, [BH], row_sl, gl.load(
        LSE + t * H + hb + gl.arange(0, BH, layout=gl.SliceLayout(0, mma))) * 1.4426950408889634)

    rows_a, _ = _tile_rows(0, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, BN, HAS_IDX, gl.SliceLayout(1, ld))
    rows_b, _ = _tile_rows(1, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, BN, HAS_IDX, gl.SliceLayout(1, ld))
    for c0 in gl.static_range(NBUF - 1):
        _gather_part(k_s, c0 % NBUF, KV, rows_a, c0, D, P, ld)
    fence_async_shared()
    gl.thread_barrier()

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
                                                REDUCE_IDX, mma, op, False)
    it = 0
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
            dkv = warpgroup_mma_wait(1, deps=(dkv, ))
            _stage_part(dkv, rows, valid, it, stage_s, rows_s, full_b, empty_b, XBAR)
            it += 1
            if i + NBUF - 1 < NP:
                _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_a, i + NBUF - 1, D, P, ld)
            else:
                _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_b, i + NBUF - 1 - NP, D, P, ld)
        sd = warpgroup_mma_wait(0, deps=(sd, ))
        dsb, ptb, rows, valid = _scores_to_operands(sd, j + 1, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, t_loc,
                                                    K_SEL, DS, NC, hb, lse2_s, delta_s, qk_scale, sm_scale, H, BN,
                                                    BH, HAS_IDX, REDUCE_IDX, mma, op, False)
    for i in gl.static_range(NP):
        dkv = warpgroup_mma(dsb, qdo_s.index(i).slice(0, BH), gl.zeros([BN, P], gl.float32, layout=mma),
                            use_acc=False, is_async=True)
        dkv = warpgroup_mma(ptb, qdo_s.index(i).slice(BH, BH), dkv, is_async=True)
        dkv = warpgroup_mma_wait(0, deps=(dkv, ))
        _stage_part(dkv, rows, valid, it, stage_s, rows_s, full_b, empty_b, XBAR)
        it += 1
    cp.wait_group(0)


@gluon.jit
def _dkv_pass_ws(Q, KV, IDX, RNG, O, DO, LSE, DELTA, DKV, DS, K_SEL, NC, t0, sq_t, sq_h, qk_scale, sm_scale,
                 H: gl.constexpr, D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NP: gl.constexpr,
                 NBUF: gl.constexpr, HAS_IDX: gl.constexpr, HAS_RNG: gl.constexpr, REDUCE_IDX: gl.constexpr = True,
                 NSTAGE: gl.constexpr = 1, RED_WARPS: gl.constexpr = 4, RED_REGS: gl.constexpr = 88,
                 XBAR: gl.constexpr = True, RED_OFF: gl.constexpr = False, SPLIT: gl.constexpr = 1):
    """Pass 1 with reducer warps of their own: the default partition (num_warps warps) computes and
    stages each dKV part in shared memory; a worker partition of RED_WARPS warps drains the stages
    with ``red``. Arguments as ``_dkv_pass``."""
    gl.static_assert(D // NP == BH)
    gl.static_assert(NP % NBUF == 0)
    P: gl.constexpr = D // NP
    dtype: gl.constexpr = Q.dtype.element_ty
    qdo_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BH, P], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, P], dtype)
    st_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=16, order=[1, 0])
    row_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    qdo_s = gl.allocate_shared_memory(dtype, [NP, 2 * BH, P], qdo_sl)
    k_s = gl.allocate_shared_memory(dtype, [NBUF, BN, P], kv_sl)
    gl.static_assert(SPLIT == 1 or SPLIT == 2)
    stage_s = gl.allocate_shared_memory(gl.float32, [NSTAGE, BN, P // SPLIT], st_sl)
    rows_s = gl.allocate_shared_memory(gl.int32, [NSTAGE, BN], row_sl)
    full_b = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty_b = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NSTAGE):
        mbarrier.init(full_b.index(s), count=1)
        mbarrier.init(empty_b.index(s), count=1)

    t = t0 + gl.program_id(0).to(gl.int64)
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
    gl.warp_specialize([
        (_consumer, (Q, KV, IDX, RNG, O, DO, LSE, DELTA, DS, K_SEL, NC, t0, sq_t, sq_h, qk_scale, sm_scale,
                     n_tiles, n0, n1, lo0, hi0, lo1, hi1, qdo_s, k_s, stage_s, rows_s, full_b, empty_b,
                     H, D, BH, BN, NP, NBUF, HAS_IDX, REDUCE_IDX, XBAR)),
        (_reducer, (DKV, stage_s, rows_s, full_b, empty_b, n_tiles * NP * SPLIT, D, NP, RED_OFF, SPLIT)),
    ], [RED_WARPS], [RED_REGS])
