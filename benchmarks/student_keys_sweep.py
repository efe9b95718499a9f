"""The KL student's key-gradient kernel at V4-Flash's indexer width: ms per call for each key block and warp count.

    python benchmarks/student_keys_sweep.py                  # 16,384 rows of a 65,536-token sequence, HI 64, dI 128

Times ``triton_student.student_scores_backward`` (both backward kernels; the dq / dw kernel does not depend on
the swept values) with ``BK_KEYS`` x ``WARPS_KEYS`` set to each pair, CUDA events, median of 5 after 2 calls,
and the key gradient's relative difference from the first pair's (summation order only). Selection as
benchmarks/student_kernel.py draws it. CUDA only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import cuda_time  # noqa: E402
from student_kernel import selection  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--pairs", nargs="*", default=["64:4", "32:4", "32:8", "16:4", "64:8"], help="BK_KEYS:WARPS")
    ap.add_argument("--shared", action="store_true",
                    help="every row past the first 2,048 selects the same 512 entries (the reductions' worst case: "
                         "6.3 ms per call on an H200 as for random selections, so contention costs nothing here)")
    a = ap.parse_args()
    from v4launch.model.kernels import triton_student as ts

    g = torch.Generator().manual_seed(0)
    T, HI, DI, K = a.rows, a.heads, 128, 512
    C = a.seq // 4
    q = torch.randn(T, HI, DI, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(T, HI, generator=g).cuda()
    keys = torch.randn(C, DI, generator=g).to("cuda", torch.bfloat16)
    sel = selection(T, a.seq, K, 4, "cuda")
    if a.shared:
        sel[2048:] = torch.arange(K, dtype=sel.dtype, device=sel.device)
    grad = (torch.randn(T, K, generator=g) * 1e-3).cuda()
    print(f"student backward: rows {T}, HI {HI}, dI {DI}, K {K}, {C} entries, {torch.cuda.get_device_name()}")
    first = None
    for pair in a.pairs:
        bk, warps = (int(x) for x in pair.split(":"))
        ts.BK_KEYS, ts.WARPS_KEYS = bk, warps
        for _ in range(2):  # the first call compiles this pair's kernel
            ts.student_scores_backward(q, w, keys, sel, grad)
        ms = cuda_time(lambda: ts.student_scores_backward(q, w, keys, sel, grad), 5)
        dk = ts.student_scores_backward(q, w, keys, sel, grad)[2].float()
        first = dk if first is None else first
        diff = float((dk - first).norm() / first.norm())
        print(f"BK_KEYS {bk:3} warps {warps}: {ms:8.2f} ms per call, d keys vs first {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
