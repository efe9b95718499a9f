"""PTX that makes the float32 dKV reductions of a wgmma accumulator cover whole cache lines.

Used by ``gluon_attention_bwd._red_add_rows_lines`` (pass 1 of the two-pass sparse-attention
backward on SM90). Plain Python, no Triton: the generated text is checked on CPU by
``tests/model/kernels/test_line_exchange.py``, which executes it on a simulated warp.

Why: from the wgmma accumulator layout a warp's ``red.global.add.v2.f32`` touches eight rows x 32
bytes, eight cache lines; the H200 sustains 565 G float32 additions/s that way and 940 G/s when
each instruction covers whole 128-byte lines (``benchmarks/reduction_layout.py``,
``benchmarks/results/reduction_rate_h200.md``).
"""

from __future__ import annotations


def line_exchange_red_asm(D: int) -> str:
    """PTX for :func:`_red_add_rows_lines`, for dKV rows of D float32.

    One thread's 32 float32 registers of an m64n64 wgmma accumulator hold (Triton's NVMMA v3 layout)
    rows g + 8 h and columns 8 n + 2 q + c, with lane = 4 g + q (g = lane bits 2..4, q = bits 0..1)
    and register = c + 2 h + 4 n (n = register bits 2..4). Two butterfly exchanges swap lane bit 4
    with register bit 3, then lane bit 3 with register bit 2 (a ``selp`` picks the value to send,
    ``shfl.sync.bfly`` swaps it with the partner lane, predicated moves put the received value back).
    Afterwards register (c, h, b2, b3, n2) of lane (g0, l3, l4, q) holds row g0 + 2 b2 + 4 b3 + 8 h,
    column 2 q + c + 8 l3 + 16 l4 + 32 n2: for a fixed register, the warp covers two rows x 32
    consecutive columns, one whole 128-byte line each. Each register's row index is read from a lane
    that held it before the exchange (``shfl.sync.idx``, one per distinct row).

    Operands: $0..$31 outputs (the working registers), $32..$63 the address of dKV[0, col0]
    (uniform), $64..$95 row indices (negative = skip the row), $96..$127 the values. Checked by
    ``tests/model/kernels/test_line_exchange.py``, which executes this PTX on a simulated warp."""
    L = ["{", ".reg .u32 lane, colb, t, src, row;", ".reg .pred p3, p4, pv;", ".reg .b32 s;", ".reg .u64 a, ra;",
         "mov.u32 lane, %laneid;", "and.b32 t, lane, 8;", "setp.ne.u32 p3, t, 0;",
         "and.b32 t, lane, 16;", "setp.ne.u32 p4, t, 0;"]
    L += [f"mov.b32 ${k}, ${96 + k};" for k in range(32)]
    for bit, mask, pred in ((8, 16, "p4"), (4, 8, "p3")):
        for i in range(32):
            if not i & bit:
                L += [f"selp.b32 s, ${i}, ${i + bit}, {pred};", f"shfl.sync.bfly.b32 s, s, {mask}, 31, -1;",
                      f"@{pred} mov.b32 ${i}, s;", f"@!{pred} mov.b32 ${i + bit}, s;"]
    # byte offset of this lane's column pair: 4 (2 q + 8 l3 + 16 l4)
    L += ["and.b32 colb, lane, 3;", "shl.b32 colb, colb, 3;", "and.b32 t, lane, 24;", "shl.b32 t, t, 2;",
          "add.u32 colb, colb, t;"]
    for h in range(2):
        for b2 in range(2):
            for b3 in range(2):
                # row g0 + 2 b2 + 4 b3 + 8 h was held by lane (lane & 7) | b2 << 3 | b3 << 4, register 2 h
                L += ["and.b32 src, lane, 7;", f"or.b32 src, src, {(b2 << 3) | (b3 << 4)};",
                      f"shfl.sync.idx.b32 row, ${64 + 2 * h}, src, 31, -1;", "setp.ge.s32 pv, row, 0;",
                      f"mul.wide.s32 ra, row, {4 * D};", "add.u64 ra, ra, $32;",
                      "cvt.u64.u32 a, colb;", "add.u64 ra, ra, a;"]
                for n2 in range(2):
                    k = 2 * h + 4 * b2 + 8 * b3 + 16 * n2
                    L += [f"add.u64 a, ra, {128 * n2};", f"@pv red.global.gpu.relaxed.add.v2.f32 [a], {{${k}, ${k + 1}}};"]
    L.append("}")
    return "\n".join(L)
