"""Parity and timing of the Gluon pass 1 against the Triton pass 1 (CSA-shaped problems, SM90 GPU).

Ablations at one size (T=..., default 65536): each variant of ``gluon_attention_bwd._dkv_pass`` timed
alone (dKV relative error against the first variant), then the Triton pass 1. Writes gl_abl_<T>.json
under $OUT. Needs R = the repository root (for benchmarks.attention).
"""
import sys, json, os, traceback
import torch
sys.path.append(os.environ["R"])
import benchmarks.attention as BA  # noqa
from v4launch.model.kernels import triton_attention as ta
from v4launch.model.kernels import triton_attention_bwd as tb
from v4launch.model.kernels import gluon_attention_bwd as gb
OUT = os.environ.get("OUT", "/tmp")
T = int(os.environ.get("T", 65536))
q, kv, idx, sink, ranges, n = BA.csa_problem(T)
o, lse = ta.attention_fwd(q, kv, idx, sink, 512 ** -0.5, ranges)
do = torch.randn_like(o)
qq, kv2, idx_t, rng_t, has_idx, has_rng, K = ta._prep(q, kv, idx, ranges)
H, D = 64, 512
NC = tb.slot_count(rng_t, K, 128)
Tc = max(1, min(T, tb.BUDGET_BYTES // (H * NC * 2)))
ds = torch.empty(Tc, H, NC, dtype=q.dtype, device=q.device)
dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
delta = torch.empty(T, H, dtype=torch.float32, device=q.device)
def p1(NBUF=4, nw=8, **fl):
    for t0 in range(0, T, Tc):
        nn = min(Tc, T - t0)
        gb._dkv_pass[(nn, 1)](qq, kv2, idx_t, rng_t, o, do, lse, delta, dkv, ds, K, NC, t0, qq.stride(0), qq.stride(1),
                              512 ** -0.5 * 1.4426950408889634, 512 ** -0.5, H=H, D=D, BH=64, BN=128, NP=8, NBUF=NBUF,
                              HAS_IDX=has_idx, HAS_RNG=has_rng, num_warps=nw, **fl)
res = []
ref = None
VARIANTS = dict(buf1=dict(), buf2=dict(DKV_BUF=2), buf1_noidx=dict(REDUCE_IDX=False), buf1_nored=dict(NO_RED=True),
                buf2_nored=dict(DKV_BUF=2, NO_RED=True), buf1_nbuf2=dict(NBUF=2))
PROFILE = os.environ.get("PROFILE")
if PROFILE:
    VARIANTS = {PROFILE: VARIANTS[PROFILE]} if PROFILE in VARIANTS else {}
for name, kw in VARIANTS.items():
    try:
        dkv.zero_(); p1(**kw); torch.cuda.synchronize()
        if ref is None: ref = dkv.clone()
        err = float((dkv - ref).norm() / ref.norm())
        ms = BA.cuda_time(lambda: p1(**kw), 1 if PROFILE else 3)
        r = dict(name=name, ms=ms, err_vs_default=err)
    except Exception:
        r = dict(name=name, error=traceback.format_exc()[-1500:])
    print(r, flush=True); res.append(r)
ms_t = BA.cuda_time(lambda: tb.attention_bwd(q, kv, idx, ranges, o, lse, do, 512 ** -0.5, passes=("dkv",), dkv_kernel="triton"), 3)
print("triton p1", ms_t); res.append(dict(name="triton_p1", ms=ms_t))
json.dump(res, open(f"{OUT}/gl_abl_{T}.json", "w"), indent=1)
