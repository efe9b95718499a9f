"""Float32 reduction rate of the GPU against the destination's footprint (the dKV floor of the backward).

    python benchmarks/reduction_rate.py [--out DIR]

The two-pass attention backward adds every (query, candidate) dKV row [D] float32 into a
shared [N, D] buffer with relaxed ``red.global.add`` (model/kernels/triton_attention_bwd.py).
This script times that operation alone: programs of R random destination rows x 512 columns,
as scalar ``tl.atomic_add`` and as ``red.global.add.v2.f32`` pairs, into destinations of
different sizes (L2-resident or not; the H200's L2 is 50 MB), against plain stores of the same
tiles. It prints Gelem/s per case, the rate that bounds the backward's reductions:
T x candidates x D elements per backward (2.15e10 for a CSA layer at 64K tokens).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from v4launch.model.kernels.triton_attention_common import red_add_rows


@triton.jit
def _reduce_rows(DST, ROWS, D: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, D)
    rows = tl.load(ROWS + pid * R + offs_r).to(tl.int64)
    vals = tl.full([R, D], 1.0, tl.float32) * (pid % 7).to(tl.float32)
    if MODE == 0:
        tl.atomic_add(DST + rows[:, None] * D + offs_d[None, :], vals, sem="relaxed")
    elif MODE == 1:
        red_add_rows(DST, rows, rows >= 0, vals, 0, D)
    else:
        tl.store(DST + rows[:, None] * D + offs_d[None, :], vals)


def rate(n_rows: int, R: int, mode: int, programs: int = 32768, D: int = 512) -> float:
    """Gelem/s for ``programs`` tiles of R random rows of an [n_rows, D] float32 destination."""
    dst = torch.zeros(n_rows, D, device="cuda")
    rows = torch.randint(0, n_rows, (programs * R,), device="cuda", dtype=torch.int32)
    warps = 4 if R <= 32 else 8
    fn = lambda: _reduce_rows[(programs,)](dst, rows, D=D, R=R, MODE=mode, num_warps=warps)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        fn()
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 5
    return programs * R * D / ms / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| destination MB | rows per tile | atomic_add Gelem/s | red.v2 Gelem/s | store Gelem/s |")
    print("|---|---|---|---|---|")
    for mb in (8, 32, 160, 1280):
        n = mb * 2 ** 20 // (512 * 4)
        for R in (32, 128):
            r = [rate(n, R, m) for m in (0, 1, 2)]
            rows.append(dict(dest_mb=mb, rows_per_tile=R, atomic_add=r[0], red_v2=r[1], store=r[2]))
            print(f"| {mb} | {R} | {r[0]:.0f} | {r[1]:.0f} | {r[2]:.0f} |", flush=True)
    with open(os.path.join(a.out, "reduction_rate.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
