"""Parity and timing of the warp-specialised Gluon pass 1 (`gluon_attention_bwd._dkv_pass_ws`) against the Triton
pass 1 on CSA-shaped problems (SM90 GPU). STAGE=parity|time, VARIANTS=JSON {name: launch kwargs}, T (time stage),
R = the repository root. Writes ws_<stage>.json under $OUT.
"""
import sys, json, os, traceback, time
import torch
sys.path.append(os.environ["R"])
import benchmarks.attention as BA  # noqa
from v4launch.model.kernels import triton_attention as ta
from v4launch.model.kernels import triton_attention_bwd as tb
from v4launch.model.kernels import gluon_attention_bwd as gb
OUT = os.environ.get("OUT", "/tmp")
res = []
def setup(T, mode="both"):
    q, kv, idx, sink, ranges, n = BA.csa_problem(T)
    if mode == "idx": ranges = None
    if mode == "rng": idx = None
    o, lse = ta.attention_fwd(q, kv, idx, sink, 512 ** -0.5, ranges)
    do = torch.randn_like(o)
    qq, kv2, idx_t, rng_t, has_idx, has_rng, K = ta._prep(q, kv, idx, ranges)
    NC = tb.slot_count(rng_t if has_rng else None, K, 128)
    Tc = max(1, min(T, tb.BUDGET_BYTES // (64 * NC * 2)))
    st = dict(q=q, kv=kv, idx=idx, ranges=ranges, o=o, lse=lse, do=do, qq=qq, kv2=kv2, idx_t=idx_t, rng_t=rng_t,
              has_idx=has_idx, has_rng=has_rng, K=K, NC=NC, Tc=Tc, T=T,
              ds=torch.empty(Tc, 64, NC, dtype=q.dtype, device=q.device),
              dkv=torch.zeros(kv.shape, dtype=torch.float32, device=q.device),
              delta=torch.empty(T, 64, dtype=torch.float32, device=q.device))
    return st
def p1ws(st, NBUF=2, maxnreg=168, **fl):
    T, Tc = st["T"], st["Tc"]
    for t0 in range(0, T, Tc):
        nn = min(Tc, T - t0)
        gb._dkv_pass_ws[(nn, 1)](st["qq"], st["kv2"], st["idx_t"], st["rng_t"], st["o"], st["do"], st["lse"], st["delta"],
                                 st["dkv"], st["ds"], st["K"], st["NC"], t0, st["qq"].stride(0), st["qq"].stride(1),
                                 512 ** -0.5 * 1.4426950408889634, 512 ** -0.5, H=64, D=512, BH=64, BN=128, NP=8, NBUF=NBUF,
                                 HAS_IDX=st["has_idx"], HAS_RNG=st["has_rng"], num_warps=8, maxnreg=maxnreg, **fl)
def tri(st, **kw):
    return tb.attention_bwd(st["q"], st["kv"], st["idx"], st["ranges"], st["o"], st["lse"], st["do"], 512 ** -0.5, **kw)
VARIANTS = json.loads(os.environ.get("VARIANTS", '{"r88": {}}'))
STAGE = os.environ.get("STAGE", "parity")
if STAGE == "parity":
    for T, mode in ((256, "both"), (2048, "both"), (2048, "idx"), (2048, "rng")):
        st = setup(T, mode)
        _, dkv_ref, de_ref = tri(st, passes=("dkv",))
        torch.cuda.synchronize()
        for name, kw in VARIANTS.items():
            try:
                st["dkv"].zero_(); t1 = time.time(); p1ws(st, **kw); torch.cuda.synchronize()
                r = dict(T=T, mode=mode, name=name, dkv=float((st["dkv"] - dkv_ref).norm() / dkv_ref.norm()),
                         delta=float((st["delta"] - de_ref).norm() / de_ref.norm()), s=time.time() - t1)
            except Exception:
                r = dict(T=T, mode=mode, name=name, error=traceback.format_exc()[-1500:])
            print(r, flush=True); res.append(r)
else:
    T = int(os.environ.get("T", 65536))
    st = setup(T)
    _, dkv_ref, _ = tri(st, passes=("dkv",))
    ms = BA.cuda_time(lambda: tri(st, passes=("dkv",)), 3)
    print({"name": "triton_p1", "ms": ms}, flush=True); res.append(dict(name="triton_p1", T=T, ms=ms))
    for name, kw in VARIANTS.items():
        try:
            st["dkv"].zero_(); p1ws(st, **kw); torch.cuda.synchronize()
            err = float((st["dkv"] - dkv_ref).norm() / dkv_ref.norm())
            ms = BA.cuda_time(lambda: p1ws(st, **kw), 3)
            r = dict(name=name, T=T, ms=ms, dkv_err=err)
        except Exception:
            r = dict(name=name, error=traceback.format_exc()[-1500:])
        print(r, flush=True); res.append(r)
json.dump(res, open(f"{OUT}/ws_{STAGE}.json", "w"), indent=1)
