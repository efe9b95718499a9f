"""The warm-up KL teacher alone at Flash width: the sparse teacher over a visible-entry table against the range
kernel (``model/kernels/triton_dense_teacher.py``) in several tile / launch settings; time and error per variant.

    python benchmarks/teacher_kernel.py                      # 64 heads x 512, chunks of 4,096 rows of a 64K segment
    python benchmarks/teacher_kernel.py --json $OUT/teacher.json

Why: in a 4-layer, 64K-token warm-up step at Flash width the teacher took 2.0 of 6.96 s (64 calls, ~142 TFLOP/s;
benchmarks/results/flash_width_h200_2026-12-04.md), the largest single kernel of the step.
Problem: one packed 64K-token segment, compress ratio 4 (16,384 entries), a chunk of 4,096 query rows starting at
``--chunk-starts`` (row t sees entries 0 .. (t + 1) // 4 - 1; the warm-up's 2^26-slot chunks at 16K entries), the
entries after 64K window rows in ``kv_all`` as in the model. FLOPs counted: 2 passes x 2 x H x D per visible
(row, entry). Timing: CUDA events, median of ``--iters`` after ``--warmup`` calls. Error: max |p - p64| over 64
rows against float64 math on the same bf16 inputs. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import cuda_time  # noqa: E402

VARIANTS = [  # (TRANSPOSED, LONGEST_FIRST, BN, BT, num_warps, num_stages); settings past 227 KiB of shared memory
    # (BN or BT 128 with 2 stages, 3 stages of 64) fail to launch on the H200 and are left out
    (0, 0, 32, 32, 8, 2), (0, 1, 64, 64, 8, 2), (0, 1, 64, 64, 4, 2),
    (1, 1, 32, 32, 4, 2), (1, 1, 64, 64, 8, 2), (1, 1, 64, 64, 4, 2), (1, 0, 64, 64, 4, 2),
    (1, 1, 64, 64, 4, 1), (1, 1, 128, 128, 4, 1), (1, 1, 128, 128, 8, 1), (1, 1, 64, 128, 4, 1),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--chunk-starts", type=int, nargs="+", default=[32768, 61440])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    from v4launch.model.kernels import triton_attention as ta
    from v4launch.model.kernels import triton_dense_teacher as td
    from v4launch.model.kernels.layer import visible_selection

    dev = torch.device("cuda")
    torch.manual_seed(0)
    H, D, E = a.heads, a.dim, a.seq // a.ratio
    scale = D ** -0.5
    kv_all = torch.randn(a.seq + E, D, device=dev, dtype=torch.bfloat16)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": H, "dim": D, "rows": []}
    print(f"{out['device']}: teacher over every visible entry, H {H} x D {D}, {a.rows} rows per chunk")
    print(f"{'chunk':>6} {'variant':<34} {'ms':>8} {'TFLOP/s':>8} {'max err':>9}")
    for g0 in a.chunk_starts:
        q = torch.randn(a.rows, H, D, device=dev, dtype=torch.bfloat16)
        nvis = ((torch.arange(g0, g0 + a.rows, device=dev) + 1) // a.ratio).int()
        first = torch.zeros(a.rows, dtype=torch.int32, device=dev)
        W = int(nvis.max())
        flops = 2 * 2 * H * D * float(nvis.sum())
        probe = torch.randperm(a.rows, device=dev)[:64]
        comp = kv_all[a.seq:].double()
        truth = torch.zeros(64, W, dtype=torch.float64, device=dev)
        for i, r in enumerate(probe.tolist()):
            n = int(nvis[r])
            truth[i, :n] = (torch.einsum("hd,cd->hc", q[r].double(), comp[:n]) * scale).softmax(-1).mean(0)

        def record(name, fn):
            res = fn()
            err = float((res[probe].double() - truth).abs().max())
            for _ in range(a.warmup):
                fn()
            ms = cuda_time(fn, a.iters)
            print(f"{g0:>6} {name:<34} {ms:8.2f} {flops / ms / 1e9:8.1f} {err:9.2e}")
            out["rows"].append(dict(chunk_start=g0, variant=name, ms=ms, tflops=flops / ms / 1e9, max_err=err))

        sel = visible_selection(first, nvis, 0, a.rows, W)
        idx = torch.where(sel >= 0, sel + a.seq, -1)
        record("sparse teacher (table)", lambda: ta.head_avg_probs(q, kv_all, idx, scale))
        ms_table = cuda_time(lambda: visible_selection(first, nvis, 0, a.rows, W), a.iters)
        print(f"{g0:>6} {'  + building the table':<34} {ms_table:8.2f}")
        for tr, lf, bn, bt, nw, ns in VARIANTS:
            td.CONFIG.clear()
            td.CONFIG.update(TRANSPOSED=bool(tr), LONGEST_FIRST=bool(lf), BN=bn, BT=bt, num_warps=nw, num_stages=ns)
            name = f"range T{tr} L{lf} BN{bn} BT{bt} w{nw} s{ns}"
            try:
                record(name, lambda: td.dense_head_avg_probs(q, kv_all, first + a.seq, nvis, W, scale))
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result, not a stop
                print(f"{g0:>6} {name:<34} failed: {type(e).__name__}: {str(e)[:80]}")
                out["rows"].append(dict(chunk_start=g0, variant=name, error=str(e)[:200]))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
