"""Float32 row reductions on SM90 by the layout that issues them (the dKV floor of pass 1).

    python benchmarks/reduction_layout.py [--out DIR]

Pass 1 of the two-pass attention backward adds every candidate tile's dKV [128 rows x 64 columns]
(one column part) into random rows of a float32 [N, 512] buffer. This script times that operation
alone, one persistent CTA of 8 warps per SM as in pass 1, 16384 tiles of 128 random rows x 512
columns into a 32 MB (L2-resident) destination, issued four ways:

* ``wgmma layout``: ``red.global.add.v2.f32`` straight from the m64n64 wgmma accumulator layout
  (a warp instruction spans eight rows x 32 bytes: eight cache lines);
* ``lane exchange``: the same registers after two butterfly exchanges between lanes
  (``model/kernels/line_exchange.py``): two rows x one whole 128-byte line per instruction;
* ``row layout``: the tile converted through shared memory to a layout where a warp covers one
  row's 64 columns;
* ``bulk (TMA)``: the tile written to a padded shared stage and added by the TMA unit
  (``cp.reduce.async.bulk``, one 256-byte row per operation, asynchronous); the stage is reused
  once the unit has read it. The stage's byte offset in dynamic shared memory is the compiler's
  choice, so the candidates from the compiled kernel are tried until the result is exact.

``--mma-work N`` adds N wgmma products [128 x 64] x [64 x 64] per part beside the reductions.
Each case checks its sums exactly against float64 (values name their tile, row and column).
Prints a markdown table (G additions/s); writes reduction_layout.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from v4launch.model.kernels.gluon_attention_bwd import _red_add_rows_lines

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import cuda_time  # noqa: E402


@gluon.jit
def _bulk_reduce_rows(OUT, rows, valid, col0, stage_off, D: gl.constexpr, ROW_BYTES: gl.constexpr,
                      NBYTES: gl.constexpr, layout: gl.constexpr):
    """Thread r < len(rows) issues ``OUT[rows[r], col0 : col0 + NBYTES / 4] += stage row r`` as one
    ``cp.reduce.async.bulk`` (float32 add in L2, asynchronous; the TMA unit reads the shared stage)
    and commits it as its own bulk group. ``stage_off`` = the stage's byte offset in the kernel's
    dynamic shared memory (``global_smem``); row r starts ROW_BYTES * r after it."""
    R: gl.constexpr = rows.shape[0]
    gaddr = (OUT + rows.to(gl.int64) * D + col0).to(gl.int64, bitcast=True)
    saddr = stage_off + gl.arange(0, R, layout=layout) * ROW_BYTES
    gl.inline_asm_elementwise(
        asm=f"""{{
        .reg .pred p, q;
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
    """Threads r < R wait until the TMA unit has read their bulk groups out of shared memory."""
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
def _red_v2(OUT, rows, vals, col0, D: gl.constexpr, layout: gl.constexpr):
    C: gl.constexpr = vals.shape[1]
    base = (OUT + rows.to(gl.int64) * D + col0).to(gl.int64, bitcast=True)
    col = gl.arange(0, C, layout=gl.SliceLayout(0, layout)) * 4
    base, col = gl.broadcast(base[:, None], col[None, :])
    gl.inline_asm_elementwise(
        asm="""{
        .reg .u64 a;
        cvt.u64.u32 a, $4;
        add.u64 a, a, $2;
        red.global.gpu.relaxed.add.v2.f32 [a], {$6, $7};
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        }""",
        constraints="=r,=r,l,l,r,r,r,r", args=[base, col, vals], dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit(do_not_specialize=["STAGE_OFF"])
def _reduce_tiles(OUT, ROWS, n_tiles, STAGE_OFF, R: gl.constexpr, D: gl.constexpr, C: gl.constexpr,
                  MODE: gl.constexpr, MMA_WORK: gl.constexpr, PAD: gl.constexpr):
    """Program p adds tiles p, p + G, ... (G programs): tile i = rows ROWS[i R ...] x D columns, in
    D / C parts of [R, C] built in the wgmma accumulator layout, value i % 7 + 1 + 100 r + c (r, c
    within the part). MODE (see the module docstring): 0 wgmma layout, 1 lane exchange (C = 64,
    D = 512), 2 row layout, 3 bulk (TMA) from a stage padded by PAD floats per row. MMA_WORK
    products [R, 64] x [64, C] per part beside the reductions."""
    NW: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, C, 16])
    st_l: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[C, PAD]], [R, C], [1, 0])
    one: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    stage = gl.allocate_shared_memory(gl.float32, [R, C], st_l)
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, 64], gl.bfloat16)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, C], gl.bfloat16)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [R, 64], a_sl,
                                    gl.zeros([R, 64], gl.bfloat16, layout=gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])))
    b_s = gl.allocate_shared_memory(gl.bfloat16, [64, C], b_sl,
                                    gl.zeros([64, C], gl.bfloat16, layout=gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])))
    fence_async_shared()
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    sink = gl.zeros([R, C], gl.float32, layout=mma)
    pid = gl.program_id(0)
    for i in range(pid, n_tiles, gl.num_programs(0)):
        rows = gl.load(ROWS + i * R + gl.arange(0, R, layout=rows_l))
        rows1 = gl.load(ROWS + i * R + gl.arange(0, R, layout=one))
        lr = gl.arange(0, R, layout=rows_l).to(gl.float32)
        lc = gl.arange(0, C, layout=gl.SliceLayout(0, mma)).to(gl.float32)
        vals = (i % 7 + 1).to(gl.float32) + 100.0 * lr[:, None] + lc[None, :]
        for part in range(D // C):
            for _ in gl.static_range(MMA_WORK):
                sink = warpgroup_mma(a_s, b_s, sink)
            if MODE == 0:
                _red_v2(OUT, rows, vals, part * C, D, mma)
            elif MODE == 1:
                _red_add_rows_lines(OUT, rows, rows >= 0, vals, part * C, D)
            elif MODE == 2:
                cl: gl.constexpr = gl.BlockedLayout([R // NW, 2], [1, 32], [NW, 1], [1, 0])
                rows_c = gl.load(ROWS + i * R + gl.arange(0, R, layout=gl.SliceLayout(1, cl)))
                _red_v2(OUT, rows_c, gl.convert_layout(vals, cl), part * C, D, cl)
            else:
                _bulk_wait_read(R, one)
                gl.thread_barrier()
                stage.store(vals)
                fence_async_shared()
                gl.thread_barrier()
                _bulk_reduce_rows(OUT, rows1, rows1 >= 0, part * C, STAGE_OFF, D, (C + PAD) * 4, C * 4, one)
    _bulk_wait_read(R, one)
    if MMA_WORK > 0:
        gl.store(OUT + gl.arange(0, R, layout=rows_l)[:, None] * 0 + gl.arange(0, C, layout=gl.SliceLayout(0, mma))[None, :] * 0,
                 sink, mask=sink > 1.0e30)


MODES = ("wgmma layout", "lane exchange", "row layout", "bulk (TMA)")


def stage_offsets(kernel) -> list[int]:
    """Candidate byte offsets of the stage in a compiled kernel's dynamic shared memory: 0 and every
    constant buffer base of its LLVM IR (the allocator's choice is not exposed; the exactness check
    of ``run`` picks the right one)."""
    consts = re.findall(r"getelementptr \(i8, ptr addrspace\(3\) @global_smem, i32 (\d+)\)", kernel.asm["llir"])
    return sorted({0, *map(int, consts)})


def run(n_rows: int, R: int, C: int, mode: int, mma_work: int, tiles: int = 16384, D: int = 512,
        check: bool = False, warps: int = 8, ctas: int = 1) -> dict:
    dst = torch.zeros(n_rows, D, device="cuda")
    rows = torch.randint(0, n_rows, (tiles * R,), device="cuda", dtype=torch.int32)
    grid = (ctas * torch.cuda.get_device_properties(0).multi_processor_count, )
    kw = dict(R=R, D=D, C=C, MODE=mode, MMA_WORK=mma_work, PAD=4, num_warps=warps)
    offs = stage_offsets(_reduce_tiles.warmup(dst, rows, tiles, 0, grid=grid, **kw))
    fn = lambda: _reduce_tiles[grid](dst, rows, tiles, offs[0], **kw)  # noqa: E731
    out = dict(dest_mb=n_rows * D * 4 / 2 ** 20, R=R, C=C, mode=MODES[mode],
               mma_work=mma_work, warps=kw["num_warps"], ctas_per_sm=ctas)
    if check:
        # value of (tile i, local row r, column c) = i % 7 + 1 + 100 r + (c % C): exact in float32
        vals = ((torch.arange(tiles, device="cuda") % 7 + 1)[:, None] + 100 * torch.arange(R, device="cuda")).flatten()
        rowsum = torch.zeros(n_rows, device="cuda", dtype=torch.float64).index_add_(0, rows.long(), vals.double())
        count = torch.zeros(n_rows, device="cuda", dtype=torch.float64).index_add_(
            0, rows.long(), torch.ones_like(vals, dtype=torch.float64))
        ref = rowsum[:, None] + count[:, None] * (torch.arange(D, device="cuda") % C).double()[None, :]
        for off in offs:
            fn = lambda: _reduce_tiles[grid](dst, rows, tiles, off, **kw)  # noqa: E731
            dst.zero_()
            fn()
            torch.cuda.synchronize()
            out["stage_off"] = off
            out["max_abs_err"] = float((dst.double() - ref).abs().max())
            if out["max_abs_err"] == 0 or mode != 3:
                break
    fn()
    ms = cuda_time(fn, reps=5)
    out["ms"] = ms
    out["gelem_per_s"] = tiles * R * D / ms / 1e6
    out["mma_tflops"] = 2 * R * 64 * C * mma_work * (D // C) * tiles / ms / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--mma-work", type=int, nargs="*", default=[0, 4])
    a = ap.parse_args()
    n = 16384  # 32 MB: the compressed-entry dKV of a 64K CSA layer
    res = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| issued as | wgmma products per part | ms | G additions/s | exact |")
    print("|---|---|---|---|---|")
    for work in a.mma_work:
        for mode in range(len(MODES)):
            try:
                r = run(n, R=128, C=64, mode=mode, mma_work=work, check=True)
                print(f"| {r['mode']} | {work} | {r['ms']:.3f} | {r['gelem_per_s']:.0f} | {r['max_abs_err'] == 0} |",
                      flush=True)
            except Exception as exc:  # keep the other cases
                r = dict(mode=MODES[mode], mma_work=work, error=repr(exc)[-2000:])
                print(r, flush=True)
            res.append(r)
    with open(os.path.join(a.out, "reduction_layout.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=res), f, indent=1)


if __name__ == "__main__":
    main()
