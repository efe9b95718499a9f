"""Two-pass Triton backward of the sparse sink attention (SM90, bf16/fp16), in query chunks.

Pass 1, ``_dkv_pass`` (one program = one query t, two warpgroups). The BN = 128 kv rows of a
candidate tile are the M dimension of every product (64 rows per warpgroup, the Hopper wgmma
minimum). q and dO of the query stay in shared memory stacked as one operand [q; dO] [2H, D]
(in NP column parts), so each tile takes two products, each a wgmma with N or K = 2H = 128:

    [S^T | dP^T] = K_tile [q; dO]^T                                 [BN, 2H]  (K = D, in NP parts)
    P^T  = exp2(S^T * scale * log2e - lse * log2e)                  (lse saved by the forward)
    dS^T = P^T * (dP^T - delta) * scale,   delta = rowsum(dO * O)   (FlashAttention-2 backward, sec. 3.1)
    dKV_tile = [dS^T | P^T] [q; dO] = dS^T q + P^T dO               [BN, D]   (V = K: one row gets both)

with [dS^T | P^T] a register operand. dKV goes to a float32 [N, D] buffer with
``red.global.add.v2.f32`` (rows are shared by many queries: window overlap, top-k reuse). dS
(scale included, q's dtype) goes to a [Tc, H, NC] buffer, one column per candidate slot.

Pass 2, ``_dq_pass`` (one program = one query, two warpgroups): dQ = dS K over the same
tiles in the same order, reading dS back instead of recomputing the scores.

Work: 10 * H * D FLOP per (query, candidate), nothing recomputed. The single-pass kernel
(``triton_attention._sparse_bwd``) recomputes the scores per output slice (22 * H * D) and
stays the float32 path: float32 q / dO parts do not fit shared memory here.
Memory: the dS buffer holds Tc queries, Tc = budget_bytes / (H * NC * itemsize); nothing in T^2.
Measured on the H200 in ``benchmarks/results/attention_h200.md``.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .triton_attention_common import LOG2E, prep_operands, red_add_rows

# Tuned on the H200 (benchmarks/attention.py --sweep; results in benchmarks/results/). The pass-1
# tile BN fixes the slot layout of the dS buffer (each range padded to whole BN tiles); pass 2 walks
# the same rows in BNQ-row tiles, BNQ capped at BN so it never reads past a range's padded slots.
CONFIGS = {"dkv": dict(BN=128, NP=4, num_warps=8, num_stages=1), "dq": dict(BNQ=64, num_warps=8, num_stages=3)}
# Pass-1 configs the sweep tries and the GPU tests check (each fits the 227 KB of shared memory
# at H = 64, D = 512 in bf16).
DKV_CANDIDATES = (dict(BN=64, NP=2, num_warps=4, num_stages=1), dict(BN=64, NP=4, num_warps=4, num_stages=1),
                  dict(BN=128, NP=4, num_warps=8, num_stages=1), dict(BN=128, NP=2, num_warps=8, num_stages=1))
DQ_CANDIDATES = (dict(BNQ=64, num_warps=8, num_stages=3), dict(BNQ=64, num_warps=8, num_stages=2),
                 dict(BNQ=32, num_warps=8, num_stages=3), dict(BNQ=128, num_warps=8, num_stages=1))
BUDGET_BYTES = 2 << 30  # dS buffer per chunk of queries
HEAD_BLOCK = 64
SMALL_HEAD_BLOCKS = (16, 32)
"""Head counts below 64 that run as one head block: the score product's N = 2 * H (32 or 64) and the dKV
product's K = 2 * H stay at or above the tensor-core minimum of 16 (V4-Flash has 64 heads; the benchmark
model 16)."""


def head_block(H: int) -> int | None:
    """Heads per program of both passes: 64 for H a multiple of 64, H itself for H in
    ``SMALL_HEAD_BLOCKS``, else None (the single-pass kernel runs)."""
    if H % HEAD_BLOCK == 0:
        return HEAD_BLOCK
    return H if H in SMALL_HEAD_BLOCKS else None


def supported(q: torch.Tensor) -> bool:
    """bf16 / fp16, heads a multiple of 64 or 16 / 32 (:func:`head_block`) and D a multiple of 16 * NP."""
    H, D = q.shape[1], q.shape[2]
    return (q.dtype in (torch.bfloat16, torch.float16) and head_block(H) is not None
            and D % (16 * CONFIGS["dkv"]["NP"]) == 0)


@triton.jit
def _tile_rows(j, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, offs_n, BN: tl.constexpr,
               HAS_IDX: tl.constexpr):
    """kv rows [BN] and validity of candidate tile j of query t: the BN-row tiles of
    range 0 (n0 of them), then of range 1 (n1), then of the index columns. Scalar conditions pick
    bounds rather than join block masks with ``&`` (Triton's interpreter turns a scalar-and-block
    ``&`` into int32, which its masked load refuses)."""
    in0 = j < n0
    in1 = (j >= n0) & (j < n0 + n1)
    start = tl.where(in0, lo0 + j * BN, tl.where(in1, lo1 + (j - n0) * BN, (j - n0 - n1) * BN))
    rows = start + offs_n
    valid = rows < tl.where(in0, hi0, hi1)
    if HAS_IDX:
        is_idx = j >= n0 + n1
        sel = tl.load(IDX + t * K_SEL + rows, mask=rows < tl.where(is_idx, K_SEL, 0), other=-1)
        valid = tl.where(is_idx, sel >= 0, valid)
        rows = tl.where(is_idx, sel, rows)
    return rows, valid


@triton.jit
def _dkv_pass(Q, KV, IDX, RNG, O, DO, LSE, DELTA, DKV, DS, K_SEL, NC, t0, sq_t, sq_h, qk_scale, sm_scale,
              H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, NP: tl.constexpr,
              HAS_IDX: tl.constexpr, HAS_RNG: tl.constexpr, USE_ASM: tl.constexpr,
              REDUCE_IDX: tl.constexpr = True):
    """Q, O, DO share strides (sq_t, sq_h, 1); program (i, j) handles query t0 + i, heads
    j * BH ... j * BH + BH - 1. q and dO stay resident stacked as [2 * BH, D / NP] column parts
    (rows 0..BH-1 from q, BH..2BH-1 from dO); the dKV accumulator is one part [BN, D / NP].
    REDUCE_IDX = False drops the dKV of index tiles (wrong result: ``benchmarks/attention.py
    --bwd-breakdown`` uses it to time what those reductions cost)."""
    t_loc = tl.program_id(0)
    t = t0 + t_loc.to(tl.int64)
    P: tl.constexpr = D // NP
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_2h = tl.arange(0, 2 * BH)
    offs_c = tl.arange(0, P)
    offs_n = tl.arange(0, BN)
    base = t * sq_t + (tl.program_id(1) * BH + offs_2h % BH)[:, None] * sq_h + offs_c[None, :]
    from_q = offs_2h[:, None] < BH
    qdo = ()
    delta2 = tl.zeros([2 * BH], tl.float32)  # rows BH.. hold rowsum(dO * O); rows ..BH stay 0
    for i in tl.static_range(NP):
        qdo_i = tl.load(tl.where(from_q, Q + base + i * P, DO + base + i * P))
        o_i = tl.load(O + base + i * P, mask=~from_q, other=0.0)
        delta2 += tl.sum(qdo_i.to(tl.float32) * o_i.to(tl.float32), 1)
        qdo = qdo + (qdo_i,)
    delta = tl.sum(tl.reshape(delta2, [2, BH]), 0)
    tl.store(DELTA + t * H + offs_h, delta)
    lse2 = tl.load(LSE + t * H + offs_h) * 1.4426950408889634
    lo0 = 0
    hi0 = 0
    lo1 = 0
    hi1 = 0
    if HAS_RNG:
        lo0 = tl.load(RNG + t * 4)
        hi0 = tl.load(RNG + t * 4 + 1)
        lo1 = tl.load(RNG + t * 4 + 2)
        hi1 = tl.load(RNG + t * 4 + 3)
    n0 = tl.cdiv(tl.maximum(hi0 - lo0, 0), BN)
    n1 = tl.cdiv(tl.maximum(hi1 - lo1, 0), BN)
    n_tiles = n0 + n1
    if HAS_IDX:
        n_tiles += tl.cdiv(K_SEL, BN)
    for j in range(0, n_tiles):  # one loop over every tile of both ranges and the index columns
        rows, valid = _tile_rows(j, n0, n1, lo0, hi0, lo1, hi1, IDX, t, K_SEL, offs_n, BN, HAS_IDX)
        kp = KV + rows.to(tl.int64)[:, None] * D + offs_c[None, :]
        sd = tl.zeros([BN, 2 * BH], tl.float32)  # [S^T | dP^T]: one product with N = 2 * BH
        for i in tl.static_range(NP):
            sd = tl.dot(tl.load(kp + i * P, mask=valid[:, None], other=0.0), tl.trans(qdo[i]), sd)
        st, dpt = tl.split(tl.permute(tl.reshape(sd, [BN, 2, BH]), (0, 2, 1)))
        pt = tl.math.exp2(st * qk_scale - lse2[None, :])
        pt = tl.where(valid[:, None], pt, 0.0)
        dsb = (pt * (dpt - delta[None, :]) * sm_scale).to(Q.dtype.element_ty)
        tl.store(DS + (t_loc * H + offs_h[None, :]).to(tl.int64) * NC + (j * BN + offs_n)[:, None], dsb)
        # [dS^T | P^T] against the stacked [q; dO]: dKV = dS^T q + P^T dO in one product with K = 2 * BH
        a_op = tl.reshape(tl.permute(tl.join(dsb, pt.to(Q.dtype.element_ty)), (0, 2, 1)), [BN, 2 * BH])
        if not REDUCE_IDX:
            valid = tl.where(j < n0 + n1, valid, False)
        for i in tl.static_range(NP):
            red_add_rows(DKV, rows, valid, tl.dot(a_op, qdo[i]), i * P, D, USE_ASM)


@triton.jit
def _dq_tile(KV, ds_base, rows, valid, slot, acc, offs_d, offs_n, D: tl.constexpr):
    """acc += dS[:, slot + offs_n] K[rows] for one BNQ-row sub-tile (rows beyond ``valid`` read 0)."""
    kvt = tl.load(KV + rows.to(tl.int64)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    ds = tl.load(ds_base + slot + offs_n[None, :])
    return tl.dot(ds, kvt, acc)


@triton.jit
def _dq_pass(KV, IDX, RNG, DS, DQ, K_SEL, NC, t0, sq_t, sq_h,
             H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BNQ: tl.constexpr,
             HAS_IDX: tl.constexpr, HAS_RNG: tl.constexpr):
    """dQ[t] = dS[t] K over the tiles and slots of ``_dkv_pass`` (dS already carries the scale);
    program (i, j): query t0 + i, head block j."""
    t_loc = tl.program_id(0)
    t = t0 + t_loc.to(tl.int64)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BNQ)
    ds_base = DS + (t_loc * H + offs_h[:, None]).to(tl.int64) * NC
    acc = tl.zeros([BH, D], tl.float32)
    # Pass 1 gives range row lo + j the slot base + j and index column j the slot base + j,
    # each range padded to whole BN tiles, so any BNQ-row walk finds its slots.
    slot = 0
    if HAS_RNG:
        for r in tl.static_range(2):
            lo = tl.load(RNG + t * 4 + 2 * r)
            hi = tl.load(RNG + t * 4 + 2 * r + 1)
            for start in range(lo, hi, BNQ):
                rows = start + offs_n
                acc = _dq_tile(KV, ds_base, rows, rows < hi, slot + (start - lo), acc, offs_d, offs_n, D)
            slot += tl.cdiv(tl.maximum(hi - lo, 0), BN) * BN
    if HAS_IDX:
        for start in range(0, K_SEL, BNQ):
            sel = start + offs_n
            rows = tl.load(IDX + t * K_SEL + sel, mask=sel < K_SEL, other=-1)
            acc = _dq_tile(KV, ds_base, rows, rows >= 0, slot + start, acc, offs_d, offs_n, D)
    tl.store(DQ + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :], acc.to(DQ.dtype.element_ty))


def slot_count(ranges: torch.Tensor | None, n_idx: int, BN: int) -> int:
    """Candidate slots per query in the dS buffer: the BN-padded tiles of both ranges (the
    largest over queries) plus those of the ``n_idx`` index columns; at least BN."""
    nc = 0
    if ranges is not None and ranges.shape[0]:
        lens = (ranges[:, 1::2].long() - ranges[:, 0::2].long()).clamp_min(0)
        nc += int(((lens + BN - 1) // BN).sum(1).max()) * BN
    nc += triton.cdiv(n_idx, BN) * BN
    return max(nc, BN)


# Triton releases the Gluon pass 1 was built and tested with. Gluon is Triton's lower-level dialect
# and its API still changes between releases: elsewhere "auto" takes the Triton pass 1 (and says why).
GLUON_TESTED_TRITON = ("3.6.",)
_UNTESTED_TRITON_SAID: list[str] = []


def gluon_pass1_unavailable(q: torch.Tensor, explicit: bool = False) -> str | None:
    """Why the Gluon pass 1 (``gluon_attention_bwd._dkv_pass``) should not run for q [T, H, D], or
    None when it can (never raises): it needs a CUDA tensor on an SM90 GPU (H100 / H200: wgmma),
    D == 512, heads a multiple of 64, bf16 / fp16, 128-row pass-1 tiles and a Triton with Gluon;
    unless ``explicit`` (the caller asked for it by name), also a Triton release in
    ``GLUON_TESTED_TRITON``."""
    H, D = q.shape[1], q.shape[2]
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "needs an SM90 GPU (H100 / H200)"
    if D != 512 or H % HEAD_BLOCK or q.dtype not in (torch.bfloat16, torch.float16):
        return f"needs D = 512, heads % {HEAD_BLOCK} == 0 and bf16 / fp16, got {q.dtype} {tuple(q.shape)}"
    if CONFIGS["dkv"]["BN"] != 128:  # its 8 warps x 16 rows; the dS slots pass 2 reads follow BN
        return f"needs pass-1 tiles of 128 kv rows, CONFIGS['dkv'] has BN = {CONFIGS['dkv']['BN']}"
    try:
        from . import gluon_attention_bwd  # noqa: F401
    except (ImportError, AttributeError) as exc:  # no Gluon, or one whose API moved
        return f"this Triton has no Gluon the kernel can use ({exc})"
    if not explicit and not triton.__version__.startswith(GLUON_TESTED_TRITON):
        return (f"was tested with Triton {', '.join(v + 'x' for v in GLUON_TESTED_TRITON)}, this is {triton.__version__} "
                "(dkv_kernel='gluon' runs it anyway)")
    return None


def attention_bwd(q, kv, idx, ranges, out, lse, dout, scale, budget_bytes: int | None = None,
                  passes: tuple[str, ...] = ("dkv", "dq"), reduce_idx: bool = True, dkv_kernel: str = "auto"):
    """Backward of :func:`triton_attention.sparse_sink_attention` for :func:`supported` q.

    q, out, dout [T, H, D]; kv [N, D]; idx [T, K] int32 (-1 masked) or None; ranges [T, 4] or
    None; lse [T, H] float32 from the forward. Returns (dq [T, H, D] q.dtype, dkv [N, D]
    float32, delta [T, H] float32 = rowsum(dout * out)). ``budget_bytes`` (default
    ``BUDGET_BYTES``) bounds the dS buffer; queries run in chunks that fit it.
    ``passes`` and ``reduce_idx`` exist for ``benchmarks/attention.py --bwd-breakdown``, which times one
    pass alone or pass 1 without the dKV reductions of index tiles; any other setting returns
    incomplete gradients. ``dkv_kernel`` picks pass 1: "gluon" (``gluon_attention_bwd``, whole-line
    dKV reductions, 10% faster on the H200 at 64K), "triton" (``_dkv_pass`` here), or "auto" (gluon
    where :func:`gluon_pass1_unavailable` says it can run on a tested Triton release, else triton).
    Raises ValueError when :func:`supported` is false for q, a pass name or ``dkv_kernel`` is
    unknown, or "gluon" cannot run."""
    if set(passes) - {"dkv", "dq"}:
        raise ValueError(f"passes={passes!r}: each must be 'dkv' (pass 1) or 'dq' (pass 2)")
    if dkv_kernel not in ("auto", "gluon", "triton"):
        raise ValueError(f"dkv_kernel={dkv_kernel!r}: must be 'auto', 'gluon' or 'triton'")
    if not supported(q):
        raise ValueError(f"two-pass backward needs bf16/fp16 q, heads % {HEAD_BLOCK} == 0 or heads in "
                         f"{SMALL_HEAD_BLOCKS} and D % 64 == 0, got "
                         f"{q.dtype} {tuple(q.shape)}; use triton_attention.attention_bwd")
    if dkv_kernel != "triton":
        why = gluon_pass1_unavailable(q, explicit=dkv_kernel == "gluon")
        if why and dkv_kernel == "gluon":
            raise ValueError(f"dkv_kernel='gluon' {why}; use dkv_kernel='triton' or 'auto'")
        if why and "tested with Triton" in why and not _UNTESTED_TRITON_SAID:
            _UNTESTED_TRITON_SAID.append(why)  # this GPU could run it: say once why the slower pass 1 runs
            warnings.warn(f"sparse-attention backward: the Gluon pass 1 {why}; using the Triton pass 1", stacklevel=2)
        dkv_kernel = "triton" if why else "gluon"
    q, kv, idx_t, rng_t, has_idx, has_rng, K = prep_operands(q, kv, idx, ranges)
    T, H, D = q.shape
    BH = head_block(H)
    c1, c2 = CONFIGS["dkv"], CONFIGS["dq"]
    BN = c1["BN"]
    dout = dout.to(q.dtype).contiguous()
    out = out.contiguous()
    lse = lse.contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    delta = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return dq, dkv, delta
    NC = slot_count(rng_t if has_rng else None, K, BN)
    Tc = max(1, min(T, (budget_bytes or BUDGET_BYTES) // (H * NC * q.element_size())))
    ds = torch.empty(Tc, H, NC, dtype=q.dtype, device=q.device)
    for t0 in range(0, T, Tc):
        n = min(Tc, T - t0)
        grid = (n, H // BH)
        if "dkv" in passes and dkv_kernel == "gluon":
            from . import gluon_attention_bwd as gb

            g = gb.CONFIG
            gb._dkv_pass[grid](q, kv, idx_t, rng_t, out, dout, lse, delta, dkv, ds, K, NC, t0, q.stride(0),
                               q.stride(1), scale * LOG2E, scale, H=H, D=D, BH=BH, BN=BN, NP=g["NP"],
                               NBUF=g["NBUF"], HAS_IDX=has_idx, HAS_RNG=has_rng, REDUCE_IDX=reduce_idx,
                               num_warps=g["num_warps"])
        elif "dkv" in passes:
            _dkv_pass[grid](q, kv, idx_t, rng_t, out, dout, lse, delta, dkv, ds, K, NC, t0, q.stride(0), q.stride(1),
                            scale * LOG2E, scale, H=H, D=D, BH=BH, BN=BN, NP=c1["NP"], HAS_IDX=has_idx,
                            HAS_RNG=has_rng, USE_ASM=q.is_cuda, REDUCE_IDX=reduce_idx,
                            num_warps=c1["num_warps"], num_stages=c1["num_stages"])
        if "dq" in passes:
            _dq_pass[grid](kv, idx_t, rng_t, ds, dq, K, NC, t0, q.stride(0), q.stride(1), H=H, D=D, BH=BH,
                           BN=BN, BNQ=min(BN, c2["BNQ"]), HAS_IDX=has_idx, HAS_RNG=has_rng,
                           num_warps=c2["num_warps"], num_stages=c2["num_stages"])
    return dq, dkv, delta
