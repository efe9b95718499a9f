"""What the sparse attention kernels share: the base-2 softmax constant, the float32 row reduction the
backward kernels add dKV with, and the operand preparation.

Used by ``triton_attention`` (forward, single-pass backward, teacher), ``triton_attention_bwd`` (two-pass
backward), ``triton_attention_query_blocks`` and ``triton_student``; it imports none of them, so the
dispatcher in ``triton_attention`` can import the backward modules at the top.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
"""log2(e): the kernels run the softmax in base 2 (``exp2(s * scale * LOG2E)``)."""


@triton.jit
def red_add_rows(OUT, rows, valid, vals, col0, D: tl.constexpr, USE_ASM: tl.constexpr = True):
    """``OUT[rows[r], col0 + c] += vals[r, c]`` for valid rows (float32, relaxed, gpu scope), one
    ``red.global.add.v2.f32`` (sm_90) per column pair. The address is formed inside the asm from
    a per-row base and a per-column offset, so no [R, C] tensor of 64-bit pointers is built.
    USE_ASM = False (Triton's CPU interpreter, which runs no inline asm) uses ``tl.atomic_add``."""
    R: tl.constexpr = vals.shape[0]
    C: tl.constexpr = vals.shape[1]
    if not USE_ASM:
        tl.atomic_add(OUT + rows.to(tl.int64)[:, None] * D + col0 + tl.arange(0, C)[None, :], vals,
                      mask=valid[:, None], sem="relaxed")
        return
    v_even, v_odd = tl.split(tl.reshape(vals, [R, C // 2, 2]))
    base = (OUT + rows.to(tl.int64) * D + col0).to(tl.int64, bitcast=True)
    base = tl.broadcast_to(base[:, None], [R, C // 2])
    col = tl.broadcast_to((tl.arange(0, C // 2) * 8)[None, :], [R, C // 2])
    ok = tl.broadcast_to(valid.to(tl.int32)[:, None], [R, C // 2])
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        .reg .u64 a;
        setp.ne.b32 p, $2, 0;
        cvt.u64.u32 a, $3;
        add.u64 a, a, $1;
        @p red.global.gpu.relaxed.add.v2.f32 [a], {$4, $5};
        mov.b32 $0, 0;
        }""",
        constraints="=r,l,r,r,r,r", args=[base, ok, col, v_even, v_odd], dtype=tl.int32, is_pure=False, pack=1)


def prep_operands(q, kv, idx, ranges):
    """The attention kernels' operands: (q, kv contiguous, idx int32 or a 1-element stand-in, ranges int32
    [T, 4] or a 4-element stand-in, has_idx, has_ranges, K = index columns per query). q [T, H, D], kv [N, D],
    idx [T, K] (-1 = none) or None, ranges [T, 4] (two half-open row ranges per query) or None."""
    q = q.contiguous()
    kv = kv.contiguous()
    has_idx = idx is not None and idx.shape[1] > 0
    idx_t = idx.to(torch.int32).contiguous() if has_idx else q.new_zeros(1, dtype=torch.int32)
    rng_t = ranges.to(torch.int32).contiguous() if ranges is not None else q.new_zeros(4, dtype=torch.int32)
    return q, kv, idx_t, rng_t, has_idx, ranges is not None, (idx.shape[1] if has_idx else 0)
