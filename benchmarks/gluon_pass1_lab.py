"""Parity and timing of the Gluon pass 1 against the Triton pass 1 (CSA-shaped problems, SM90 GPU).

    T=65536 VARIANTS=red,bulk,bulk_nored python benchmarks/gluon_pass1_lab.py

Each variant of ``gluon_attention_bwd._dkv_pass`` is timed alone; its dKV and dS are compared with the
Triton pass 1's (relative error). The bulk variants need the byte offset of their shared stage, which
the compiler chooses: the candidates from the compiled kernel are tried until dKV matches. Writes
gl_abl_<T>.json under $OUT. Needs R = the repository root (for benchmarks.attention).
"""
import json
import os
import sys
import traceback

import torch

sys.path.append(os.environ["R"])
import benchmarks.attention as BA  # noqa: E402
from v4launch.model.kernels import gluon_attention_bwd as gb  # noqa: E402
from v4launch.model.kernels import triton_attention as ta  # noqa: E402
from v4launch.model.kernels import triton_attention_bwd as tb  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
T = int(os.environ.get("T", 65536))
torch.manual_seed(0)
q, kv, idx, sink, ranges, n = BA.csa_problem(T)
o, lse = ta.attention_fwd(q, kv, idx, sink, 512 ** -0.5, ranges)
do = torch.randn_like(o)
qq, kv2, idx_t, rng_t, has_idx, has_rng, K = ta._prep(q, kv, idx, ranges)
H, D = 64, 512
NC = tb.slot_count(rng_t, K, 128)
Tc = max(1, min(T, tb.BUDGET_BYTES // (H * NC * 2)))
ds = torch.zeros(Tc, H, NC, dtype=q.dtype, device=q.device)
dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
delta = torch.empty(T, H, dtype=torch.float32, device=q.device)


def p1(stage_off=0, NBUF=4, nw=8, **fl):
    k = None
    for t0 in range(0, T, Tc):
        nn = min(Tc, T - t0)
        k = gb._dkv_pass[(nn, 1)](qq, kv2, idx_t, rng_t, o, do, lse, delta, dkv, ds, K, NC, t0, qq.stride(0),
                                  qq.stride(1), 512 ** -0.5 * 1.4426950408889634, 512 ** -0.5, stage_off, H=H, D=D,
                                  BH=64, BN=128, NP=8, NBUF=NBUF, HAS_IDX=has_idx, HAS_RNG=has_rng, num_warps=nw, **fl)
    return k


# reference: the two-pass backward with the Triton pass 1
res = []
dkv_ref = None
try:
    dkv_ref = tb.attention_bwd(q, kv, idx, ranges, o, lse, do, 512 ** -0.5)[1].float()
except Exception:
    res.append(dict(name="reference", error=traceback.format_exc()[-1500:]))

VARIANTS = dict(red=dict(), red_nored=dict(NO_RED=True), bulk=dict(BULK=True), bulk_nored=dict(BULK=True, NO_RED=True),
                bulk_noidx=dict(BULK=True, REDUCE_IDX=False), bulk_pad8=dict(BULK=True, PAD=8),
                bulk_whole_nbuf2=dict(BULK=True, HALVES=1, NBUF=2),
                rowred=dict(ROWRED=True), rowred_whole=dict(ROWRED=True, HALVES=1),
                rowred_nored=dict(ROWRED=True, NO_RED=True),
                linered=dict(LINERED=2), linered_nored=dict(LINERED=2, NO_RED=True),
                linered1=dict(LINERED=1), linered1_nored=dict(LINERED=1, NO_RED=True))
sel = os.environ.get("VARIANTS", "red,bulk,bulk_nored").split(",")
for name in sel:
    kw = VARIANTS[name]
    try:
        r = dict(name=name)
        offs = [0]
        if kw.get("BULK"):
            dkv.zero_()
            kern = p1(**kw)
            torch.cuda.synchronize()
            offs = gb.stage_offset_candidates(kern, 128 * (64 // kw.get('HALVES', 2) + kw.get('PAD', 4)) * 4)
        for off in offs:
            dkv.zero_()
            p1(stage_off=off, **kw)
            torch.cuda.synchronize()
            if dkv_ref is not None:
                r["dkv_rel_err"] = float((dkv - dkv_ref).norm() / dkv_ref.norm())
            r["stage_off"] = off
            if kw.get("NO_RED") or kw.get("REDUCE_IDX") is False or r.get("dkv_rel_err", 0) < 1e-3:
                break
        r["ms"] = BA.cuda_time(lambda: p1(stage_off=r["stage_off"], **kw), 3)
    except Exception:
        r["error"] = traceback.format_exc()[-1500:]
    print(r, flush=True)
    res.append(r)
ms_t = BA.cuda_time(lambda: tb.attention_bwd(q, kv, idx, ranges, o, lse, do, 512 ** -0.5, passes=("dkv",)), 3)
print("triton p1", ms_t)
res.append(dict(name="triton_p1", ms=ms_t))
json.dump(res, open(f"{OUT}/gl_abl_{T}.json", "w"), indent=1)
