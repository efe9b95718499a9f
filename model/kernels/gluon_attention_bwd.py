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
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

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


def _line_red_asm(stages: int, D: int) -> str:
    """PTX for ``_red_add_rows_lines``: the 32 float32 accumulator registers of one thread of an
    m64n64 wgmma layout (register bits: column 1, row 8, columns 8 / 16 / 32; lane bits: columns
    2 / 4, rows 1 / 2 / 4) go through ``stages`` butterfly exchanges between lanes (lane bit 4 with
    register bit 3, then lane bit 3 with register bit 2). After two, each ``red.v2`` instruction of a
    warp covers two rows x one whole 128-byte line; after one, four rows x 64 bytes; without, eight
    rows x 32 bytes. Each register's row index comes from the lane that held it (one ``shfl`` per
    distinct row). Operands: $0..$31 outputs (working registers), $32..$63 the address of
    dKV[0, col0] (uniform), $64..$95 row indices (-1 = skip), $96..$127 values."""
    assert stages in (1, 2)
    L = ["{", ".reg .u32 lane, colb, t, src, row;", ".reg .pred p3, p4, pv;", ".reg .b32 s;", ".reg .u64 a, ra;",
         "mov.u32 lane, %laneid;", "and.b32 t, lane, 8;", "setp.ne.u32 p3, t, 0;",
         "and.b32 t, lane, 16;", "setp.ne.u32 p4, t, 0;"]
    L += [f"mov.b32 ${k}, ${96 + k};" for k in range(32)]
    for bit, mask, pred in ((8, 16, "p4"), (4, 8, "p3"))[:stages]:
        for i in range(32):
            if not i & bit:
                L += [f"selp.b32 s, ${i}, ${i + bit}, {pred};", f"shfl.sync.bfly.b32 s, s, {mask}, 31, -1;",
                      f"@{pred} mov.b32 ${i}, s;", f"@!{pred} mov.b32 ${i + bit}, s;"]
    # column byte offset of this lane: 4 (2 q) + 4 (16 lane bit 4) [+ 4 (8 lane bit 3) after two stages]
    L += ["and.b32 colb, lane, 3;", "shl.b32 colb, colb, 3;", "and.b32 t, lane, 16;", "shl.b32 t, t, 2;",
          "add.u32 colb, colb, t;"]
    if stages == 2:
        L += ["and.b32 t, lane, 8;", "shl.b32 t, t, 2;", "add.u32 colb, colb, t;"]
    keep = 7 if stages == 2 else 15  # lane bits that still name this register's row group
    for h in range(2):
        for r2 in range(2 if stages == 2 else 1):
            for r3 in range(2):
                L += [f"and.b32 src, lane, {keep};", f"or.b32 src, src, {(r2 << 3) | (r3 << 4)};",
                      f"shfl.sync.idx.b32 row, ${64 + 2 * h}, src, 31, -1;", "setp.ge.s32 pv, row, 0;",
                      "mul.wide.s32 ra, row, %d;" % (4 * D), f"add.u64 ra, ra, $32;",
                      "cvt.u64.u32 a, colb;", "add.u64 ra, ra, a;"]
                for n2 in range(2):
                    for r2b in ((r2,) if stages == 2 else (0, 1)):
                        k = 2 * h + 4 * r2b + 8 * r3 + 16 * n2
                        off = 128 * n2 + (0 if stages == 2 else 32 * r2b)
                        L += [f"add.u64 a, ra, {off};", f"@pv red.global.gpu.relaxed.add.v2.f32 [a], {{${k}, ${k + 1}}};"]
    L.append("}")
    return "\n".join(L)


LINE_RED_ASM = gl.constexpr(_line_red_asm(2, 512))
LINE_RED_ASM1 = gl.constexpr(_line_red_asm(1, 512))
LINE_RED_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 32 + ["l"] * 32 + ["r"] * 32 + ["r"] * 32))


@gluon.jit
def _red_add_rows_lines(OUT, rows, valid, vals, col0, D: gl.constexpr, STAGES: gl.constexpr = 2):
    """``OUT[rows[r], col0 + c] += vals[r, c]`` for valid rows, vals [BN, 64] float32 in the m64n64
    wgmma accumulator layout (8 warps, instr [16, 64, 16]), D == 512; lanes exchange values first so
    each ``red.global.add.v2.f32`` covers whole 128-byte lines (``_line_red_asm``)."""
    gl.static_assert(D == 512)
    r = gl.where(valid, rows, -1)
    base = (OUT + col0).to(gl.int64, bitcast=True) + gl.zeros_like(vals).to(gl.int64)
    r, v = gl.broadcast(r[:, None], vals)
    if STAGES == 2:
        gl.inline_asm_elementwise(asm=LINE_RED_ASM, constraints=LINE_RED_CONSTRAINTS, args=[base, r, v],
                                  dtype=gl.int32, is_pure=False, pack=32)
    else:
        gl.inline_asm_elementwise(asm=LINE_RED_ASM1, constraints=LINE_RED_CONSTRAINTS, args=[base, r, v],
                                  dtype=gl.int32, is_pure=False, pack=32)


@gluon.jit
def _bulk_reduce_rows(OUT, rows, valid, col0, stage_off, D: gl.constexpr, ROW_BYTES: gl.constexpr,
                      NBYTES: gl.constexpr, layout: gl.constexpr):
    """Thread r < len(rows) issues ``OUT[rows[r], col0 : col0 + NBYTES / 4] += stage row r`` as one
    ``cp.reduce.async.bulk`` (float32 add done in L2 by the TMA unit, which reads the shared stage
    asynchronously) and commits it as its own bulk group; invalid rows issue nothing. ``stage_off`` =
    the stage's byte offset in the kernel's dynamic shared memory (``global_smem``), row r starting
    ROW_BYTES * r after it. ``layout`` must give element r to thread r."""
    R: gl.constexpr = rows.shape[0]
    gaddr = (OUT + rows.to(gl.int64) * D + col0).to(gl.int64, bitcast=True)
    saddr = stage_off + gl.arange(0, R, layout=layout) * ROW_BYTES
    gl.inline_asm_elementwise(
        asm=f"""{{
        .reg .pred p;
        .reg .u32 t, s;
        mov.u32 t, %tid.x;
        setp.lt.u32 p, t, {R};
        setp.ne.and.b32 p, $3, 0, p;
        mov.u32 s, global_smem;
        add.u32 s, s, $2;
        @p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$1], [s], {NBYTES};
        @p cp.async.bulk.commit_group;
        mov.b32 $0, 0;
        }}""",
        constraints="=r,l,r,r", args=[gaddr, saddr, valid.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bulk_wait_read(R: gl.constexpr, layout: gl.constexpr):
    """Threads r < R wait until the TMA unit has read all their bulk groups out of shared memory."""
    gl.inline_asm_elementwise(
        asm=f"""{{
        .reg .pred p;
        .reg .u32 t;
        mov.u32 t, %tid.x;
        setp.lt.u32 p, t, {R};
        @p cp.async.bulk.wait_group.read 0;
        mov.b32 $0, 0;
        }}""",
        constraints="=r,r", args=[gl.arange(0, R, layout=layout)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stage_and_issue(DKV, rows1, valid1, vals, col0, stage, stage_off, D: gl.constexpr, one: gl.constexpr,
                     PAD: gl.constexpr):
    """Wait until the TMA unit has read the stage, write vals [BN, C] into it, issue one bulk
    reduction per valid row into dKV[rows, col0 : col0 + C]."""
    C: gl.constexpr = vals.shape[1]
    _bulk_wait_read(vals.shape[0], one)
    gl.thread_barrier()
    stage.store(vals)
    fence_async_shared()
    gl.thread_barrier()
    _bulk_reduce_rows(DKV, rows1, valid1, col0, stage_off, D, (C + PAD) * 4, C * 4, one)


@gluon.jit
def _reduce_part(DKV, rows, valid, rows1, valid1, dkv, col0, stage, stage_off, D: gl.constexpr, mma: gl.constexpr,
                 one: gl.constexpr, BULK: gl.constexpr, PAD: gl.constexpr, HALVES: gl.constexpr,
                 ROWRED: gl.constexpr, LINERED: gl.constexpr):
    """dKV[rows, col0 ...] += dkv [BN, P]: ``red.v2`` from registers, or (BULK) through the padded
    shared stage and the TMA unit, whole or in two column halves (HALVES = 2: a stage of half the
    shared memory)."""
    if LINERED > 0:
        _red_add_rows_lines(DKV, rows, valid, dkv, col0, D, LINERED)
    elif ROWRED:
        # red.v2 from a row-contiguous layout (a warp instruction covers whole 128-byte lines of two
        # rows) instead of the wgmma layout (eight rows per instruction), through shared memory
        BN: gl.constexpr = dkv.shape[0]
        P: gl.constexpr = dkv.shape[1]
        NW: gl.constexpr = gl.num_warps()
        if HALVES == 2:
            rl: gl.constexpr = gl.BlockedLayout([BN // NW // 2, 2], [2, 16], [NW, 1], [1, 0])
            lo, hi = gl.split(gl.permute(gl.reshape(dkv, [BN, 2, P // 2]), (0, 2, 1)))
            rows_r = gl.convert_layout(rows, gl.SliceLayout(1, rl))
            valid_r = gl.convert_layout(valid, gl.SliceLayout(1, rl))
            _red_add_rows(DKV, rows_r, valid_r, gl.convert_layout(lo, rl), col0, D, rl)
            _red_add_rows(DKV, rows_r, valid_r, gl.convert_layout(hi, rl), col0 + P // 2, D, rl)
        else:
            rl: gl.constexpr = gl.BlockedLayout([BN // NW, 2], [1, 32], [NW, 1], [1, 0])
            rows_r = gl.convert_layout(rows, gl.SliceLayout(1, rl))
            valid_r = gl.convert_layout(valid, gl.SliceLayout(1, rl))
            _red_add_rows(DKV, rows_r, valid_r, gl.convert_layout(dkv, rl), col0, D, rl)
    elif BULK:
        if HALVES == 2:
            BN: gl.constexpr = dkv.shape[0]
            P: gl.constexpr = dkv.shape[1]
            lo, hi = gl.split(gl.permute(gl.reshape(dkv, [BN, 2, P // 2]), (0, 2, 1)))
            _stage_and_issue(DKV, rows1, valid1, lo, col0, stage, stage_off, D, one, PAD)
            _stage_and_issue(DKV, rows1, valid1, hi, col0 + P // 2, stage, stage_off, D, one, PAD)
        else:
            _stage_and_issue(DKV, rows1, valid1, dkv, col0, stage, stage_off, D, one, PAD)
    else:
        _red_add_rows(DKV, rows, valid, dkv, col0, D, mma)


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


@gluon.jit(do_not_specialize=["STAGE_OFF"])
def _dkv_pass(Q, KV, IDX, RNG, O, DO, LSE, DELTA, DKV, DS, K_SEL, NC, t0, sq_t, sq_h, qk_scale, sm_scale, STAGE_OFF,
              H: gl.constexpr, D: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, NP: gl.constexpr,
              NBUF: gl.constexpr, HAS_IDX: gl.constexpr, HAS_RNG: gl.constexpr, REDUCE_IDX: gl.constexpr = True,
              DKV_BUF: gl.constexpr = 1, NO_RED: gl.constexpr = False, BULK: gl.constexpr = False,
              PAD: gl.constexpr = 4, HALVES: gl.constexpr = 2, ROWRED: gl.constexpr = False,
              LINERED: gl.constexpr = 0):
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
    one: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    if BULK:
        SC: gl.constexpr = P // HALVES
        stage = gl.allocate_shared_memory(gl.float32, [BN, SC],
                                          gl.PaddedSharedLayout.with_identity_for([[SC, PAD]], [BN, SC], [1, 0]))
    else:
        stage = k_s

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
    rows1 = gl.convert_layout(rows, one)
    valid1 = gl.convert_layout(valid, one)

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
                    _reduce_part(DKV, rows, valid, rows1, valid1, dkv_prev, (i - 1) * P, stage, STAGE_OFF, D, mma, one, BULK, PAD, HALVES, ROWRED, LINERED)
                dkv_prev = dkv
            else:
                dkv = warpgroup_mma_wait(1, deps=(dkv, ))  # tile j + 1's part-i scores stay in flight
                _reduce_part(DKV, rows, valid, rows1, valid1, dkv, i * P, stage, STAGE_OFF, D, mma, one, BULK, PAD, HALVES, ROWRED, LINERED)
            if i + NBUF - 1 < NP:
                _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_a, i + NBUF - 1, D, P, ld)
            else:
                _gather_part(k_s, (i + NBUF - 1) % NBUF, KV, rows_b, i + NBUF - 1 - NP, D, P, ld)
        if DKV_BUF == 2:
            dkv_prev, sd = warpgroup_mma_wait(0, deps=(dkv_prev, sd))
            _reduce_part(DKV, rows, valid, rows1, valid1, dkv_prev, (NP - 1) * P, stage, STAGE_OFF, D, mma, one, BULK, PAD, HALVES, ROWRED, LINERED)
        else:
            sd = warpgroup_mma_wait(0, deps=(sd, ))
        dsb, ptb, rows, valid = _scores_to_operands(sd, j + 1, n_tiles, n0, n1, lo0, hi0, lo1, hi1, IDX, t, t_loc,
                                                    K_SEL, DS, NC, hb, lse2_s, delta_s, qk_scale, sm_scale, H, BN,
                                                    BH, HAS_IDX, REDUCE_IDX, mma, op, NO_RED)
        rows1 = gl.convert_layout(rows, one)
        valid1 = gl.convert_layout(valid, one)
    # the last tile's dKV
    for i in gl.static_range(NP):
        dkv = warpgroup_mma(dsb, qdo_s.index(i).slice(0, BH), gl.zeros([BN, P], gl.float32, layout=mma),
                            use_acc=False, is_async=True)
        dkv = warpgroup_mma(ptb, qdo_s.index(i).slice(BH, BH), dkv, is_async=True)
        dkv = warpgroup_mma_wait(0, deps=(dkv, ))
        _reduce_part(DKV, rows, valid, rows1, valid1, dkv, i * P, stage, STAGE_OFF, D, mma, one, BULK, PAD, HALVES, ROWRED, LINERED)
    cp.wait_group(0)
    if BULK:
        _bulk_wait_read(BN, one)


def stage_offset_candidates(kernel, stage_bytes: int) -> list[int]:
    """Byte offsets where a compiled ``_dkv_pass`` (BULK) may have put its shared stage of
    ``stage_bytes``: 0 and every constant buffer base in its LLVM IR that leaves room for it, largest
    first. The allocator's choice is not exposed to the kernel source."""
    import re

    consts = re.findall(r"getelementptr \(i8, ptr addrspace\(3\) @global_smem, i32 (\d+)\)", kernel.asm["llir"])
    return sorted({o for o in {0, *map(int, consts)} if o + stage_bytes <= kernel.metadata.shared}, reverse=True)
