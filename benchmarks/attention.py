"""V4-Flash attention layers (SWA, CSA with indexer, HCA) forward + backward on one GPU.

    python benchmarks/attention.py                       # full table (8K..128K), needs an SM90 GPU
    python benchmarks/attention.py --sizes 8192 --quick  # smoke run
    V4_MODEL_DIR=/path/to/model python benchmarks/attention.py   # benchmark a snapshot of model/

Shapes: ModelArgs() defaults = V4-Flash (dim 4096, 64 heads x 512, rope 64, window 128,
indexer 64 x 128 top-512, o_groups 8), bf16 parameters (sink/ape fp32-pinned), one
packed segment of T tokens. Paths:
  kernels   - v4launch.model.kernels.attention_forward with select_backend("triton")
  reference - the module itself (Attention.forward, chunk_size 256)
  sdpa      - dense causal MQA attention of the same head shape through torch SDPA (context)

FLOP counts (useful work only; recompute in the backward is not credited):
  attention core fwd = 4 * H * D * sum_t n_cand(t), bwd = 10 * H * D * sum_t n_cand(t)
      n_cand(t) = window keys + compressed entries attended (top-k, or all visible)
  indexer scoring    = 2 * H_I * d_I * sum_t n_visible(t)   (ReLU/weight/top-k not credited)
  sdpa causal        = fwd 4 * H * D * T(T+1)/2, bwd 2.5x
Percentages are of the bf16 matmul rate measured in the same run (8192^3, random data).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def load_model_package():
    """Import ``v4launch.model`` from $V4_MODEL_DIR, else the installed package, else ./model."""
    src = os.environ.get("V4_MODEL_DIR")
    if not src:
        try:
            import v4launch.model as m  # noqa: F401
            return m
        except ImportError:
            src = str(REPO / "model")
    if "v4launch" not in sys.modules:
        try:
            import v4launch  # noqa: F401
        except ImportError:
            pkg = types.ModuleType("v4launch")
            pkg.__path__ = []
            sys.modules["v4launch"] = pkg
    spec = importlib.util.spec_from_file_location("v4launch.model", os.path.join(src, "__init__.py"),
                                                  submodule_search_locations=[src])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["v4launch.model"] = mod
    spec.loader.exec_module(mod)
    return mod


M = load_model_package()
from v4launch.model import ModelArgs  # noqa: E402
from v4launch.model.attention import Attention, BatchContext  # noqa: E402
from v4launch.model.kernels import attention_forward, select_backend  # noqa: E402
from v4launch.model.packing import make_pack  # noqa: E402

DEV = "cuda"
LAYERS = [  # name, layer id in the Flash schedule, indexer, kl target, phase
    ("CSA", 2, True, "selected", "sparse"),
    ("SWA", 0, False, "selected", "-"),
    ("HCA", 3, False, "selected", "-"),
    ("CSA", 2, False, "selected", "dense"),
    ("CSA", 2, True, "visible", "warmup"),
]


def sync():
    torch.cuda.synchronize()


def cuda_time(fn, reps=1):
    """Median milliseconds of fn() over reps, CUDA events."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        sync()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def matmul_peak():
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = cuda_time(lambda: a @ b, 10)
    return 2 * n ** 3 / ms / 1e9  # TFLOP/s


def copy_bw():
    x = torch.randn(2 ** 30 // 2, device=DEV)  # 2 GiB fp32
    y = torch.empty_like(x)
    y.copy_(x)
    ms = cuda_time(lambda: y.copy_(x), 10)
    return 2 * x.numel() * 4 / ms / 1e9  # TB/s, read + write


def make_layer(lid, indexer, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    args = ModelArgs()
    attn = Attention(lid, args, with_indexer=indexer)
    with torch.no_grad():
        attn.attn_sink.normal_(0, 0.5)
        for name, p in attn.named_parameters():
            if name.endswith("ape"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    return attn.to(DEV).to(dtype), args


class Capture:
    """Backend wrapper that records the core / indexer inputs of the last layer call."""

    def __init__(self, backend):
        self.b, self.core, self.idx = backend, None, None

    def wrap(self):
        b = self.b

        def attn(q, kv, idx, sink, scale, ranges=None):
            self.core = (q.detach(), kv.detach(), idx, sink.detach(), scale, ranges)
            return b.sparse_sink_attention(q, kv, idx, sink, scale, ranges)

        def topk(*a):
            self.idx = tuple(x.detach() if torch.is_tensor(x) else x for x in a)
            return b.indexer_topk(*a)

        return dataclasses.replace(b, sparse_sink_attention=attn, indexer_topk=topk)


def step(path, attn, x, g, ctx_args, backend=None):
    """One forward (+ backward) of a layer; returns (fwd ms, bwd ms, peak GB, out, kl)."""
    ctx = BatchContext(*ctx_args)
    attn.zero_grad(set_to_none=True)
    x.grad = None
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    a.record()
    out, kl = attn(x, ctx) if path == "reference" else attention_forward(attn, x, ctx, backend)
    b.record()
    loss = (out.float() * g).sum() + (kl.float() if kl is not None else 0.0)
    loss.backward()
    c.record()
    sync()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return a.elapsed_time(b), b.elapsed_time(c), peak, out.detach(), (kl.detach() if kl is not None else None)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grads_of(attn, x):
    d = {n: p.grad.detach().clone() for n, p in attn.named_parameters() if p.grad is not None}
    d["x"] = x.grad.detach().clone()
    return d


def parity(T, dtype, layers="all"):
    """Kernel path vs reference path on every layer type/phase: max rel error of out, kl, all grads."""
    rows = []
    backend = select_backend("triton", DEV)
    for name, lid, ind, target, phase in LAYERS:
        if layers != "all" and f"{name}-{phase}" not in layers.split(","):
            continue
        attn, args = make_layer(lid, ind, dtype)
        gen = torch.Generator(device=DEV).manual_seed(int(time.time()) % 100000)
        x = torch.randn(T, args.dim, device=DEV, generator=gen).to(dtype).requires_grad_()
        g = torch.randn(T, args.dim, device=DEV, generator=gen)
        lengths = [T // 2, T // 4, T - T // 2 - T // 4]
        cu = torch.tensor([0, lengths[0], lengths[0] + lengths[1], T], device=DEV)
        pack = make_pack(torch.zeros(T, dtype=torch.long, device=DEV), cu, max(lengths))
        res = {}
        for path in ("reference", "kernels"):
            _, _, _, out, kl = step(path, attn, x, g, (pack, args.window_size, target, 256), backend)
            res[path] = (out, kl, grads_of(attn, x))
        if dtype != torch.float32:  # ground truth: the reference path in float32 on the same weights/inputs
            import copy
            a32 = copy.deepcopy(attn).float()
            x32 = x.detach().float().requires_grad_()
            _, _, _, out, kl = step("reference", a32, x32, g, (pack, args.window_size, target, 256), backend)
            res["fp32"] = (out, kl, grads_of(a32, x32))
            del a32, x32

        def errs_of(a, b):
            (o1, k1, g1), (o2, k2, g2) = res[b], res[a]
            e = {"out": rel(o2, o1)}
            if k1 is not None:
                e["kl"] = rel(k2, k1)
            ge = {n: rel(g2[n], g1[n]) for n in g1}
            w = max(ge, key=ge.get)
            e["grad(max)"] = ge[w]
            return e, w

        errs, worst = errs_of("kernels", "reference")
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        ok = all(v <= tol for v in errs.values())
        extra = {}
        if "fp32" in res:
            ek, wk = errs_of("kernels", "fp32")
            er, wr = errs_of("reference", "fp32")
            extra = dict(kern_vs_fp32=ek, kern_vs_fp32_worst=wk, ref_vs_fp32=er, ref_vs_fp32_worst=wr)
            ok = ok or all(v <= tol for v in ek.values())
            print(f"   vs fp32 truth: kernels {ek} ({wk}); reference bf16 {er} ({wr})", flush=True)
        rows.append(dict(layer=name, phase=phase, dtype=str(dtype).split(".")[-1], T=T, **errs,
                         worst_grad=worst, ok=ok, **extra))
        print(f"parity {name:3s} {phase:6s} {str(dtype):14s} T={T}: " +
              " ".join(f"{k}={v:.2e}" for k, v in errs.items()) + f" (worst grad {worst}) {'OK' if ok else 'FAIL'}",
              flush=True)
        del attn, x, g, res
        torch.cuda.empty_cache()
    return rows


def core_numbers(cap, reps):
    """Time the captured attention core (fwd, fwd+bwd) and indexer (scores, scores+top-k)."""
    from v4launch.model.kernels import triton_attention as ta
    from v4launch.model.kernels import triton_indexer as ti

    q, kv, idx, sink, scale, ranges = cap.core
    H, D = q.shape[1], q.shape[2]
    n = (ranges[:, 1] - ranges[:, 0]).clamp_min(0).sum() + (ranges[:, 3] - ranges[:, 2]).clamp_min(0).sum()
    if idx is not None:
        n = n + (idx >= 0).sum()
    n = int(n)
    fwd_flop, bwd_flop = 4 * H * D * n, 10 * H * D * n
    out_box = {}

    def f():
        out_box["o"] = ta.attention_fwd(q, kv, idx, sink, scale, ranges)

    f()
    t_f = cuda_time(f, reps)
    o, lse = out_box["o"]
    do = torch.randn_like(o)
    ta.attention_bwd(q, kv, idx, ranges, o, lse, do, scale)
    t_b = cuda_time(lambda: ta.attention_bwd(q, kv, idx, ranges, o, lse, do, scale), reps)
    r = dict(core_fwd_ms=t_f, core_bwd_ms=t_b, core_fwd_tflops=fwd_flop / t_f / 1e9,
             core_bwd_tflops=bwd_flop / t_b / 1e9, core_tflops=(fwd_flop + bwd_flop) / (t_f + t_b) / 1e9,
             candidates=n)
    if cap.idx is not None:
        iq, iw, keys, first, nvis, k, maxe = cap.idx
        flop = 2 * iq.shape[1] * iq.shape[2] * int(nvis.long().sum())
        end = (first + nvis).long()
        T = iq.shape[0]
        rows_per = max(64, min(T, 2 ** 27 // max(1, maxe)))

        def scores_only():
            for r0 in range(0, T, rows_per):
                r1 = min(T, r0 + rows_per)
                lo = int(first[r0])
                ti.indexer_scores(iq[r0:r1], iw[r0:r1], keys, first[r0:r1], nvis[r0:r1], lo, int(end[r0:r1].max()))

        scores_only()
        t_s = cuda_time(scores_only, reps)
        t_k = cuda_time(lambda: ti.indexer_topk(iq, iw, keys, first, nvis, k, maxe), reps)
        r.update(idx_score_ms=t_s, idx_topk_ms=t_k, idx_score_tflops=flop / t_s / 1e9,
                 idx_tflops=flop / t_k / 1e9)
    return r


def sdpa_time(T, H, D, reps):
    q = torch.randn(1, H, T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1, T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 1, T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    F = torch.nn.functional.scaled_dot_product_attention

    def run():
        o = F(q, k.expand(1, H, T, D), v.expand(1, H, T, D), is_causal=True)
        o.backward(torch.ones_like(o))

    run()
    ms = cuda_time(run, reps)
    flop = 4 * H * D * T * (T + 1) / 2 * 3.5
    return ms, flop / ms / 1e9


SWEEP = {
    "fwd": [dict(BN=64, n_split=1, num_warps=8, num_stages=2), dict(BN=32, n_split=1, num_warps=8, num_stages=2),
            dict(BN=64, n_split=1, num_warps=8, num_stages=1), dict(BN=128, n_split=1, num_warps=8, num_stages=1),
            dict(BN=64, n_split=2, num_warps=8, num_stages=2)],
    # two-pass backward (triton_attention_bwd): pass-1 tile config, pass 2 keeps its own
    "bwd": None,  # triton_attention_bwd.DKV_CANDIDATES (the GPU tests check each)
    "bwd_dq": None,  # triton_attention_bwd.DQ_CANDIDATES
}


def csa_problem(T, H=64, D=512, K=512, W=128):
    """A CSA-shaped core problem with random data: q [T, H, D], kv [T + T/4, D] (raw rows, then the
    compressed entries), idx [T, K] (random visible entries; may repeat: timing only), the window
    range [t - W + 1, t]; returns (q, kv, idx, sink, ranges, candidates)."""
    C = T // 4
    q = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(T + C, D, device=DEV, dtype=torch.bfloat16)
    sink = torch.randn(H, device=DEV)
    t = torch.arange(T, device=DEV)
    nvis = (t + 1) // 4
    idx = (torch.rand(T, K, device=DEV) * nvis[:, None].clamp_min(1)).long()
    idx = torch.where(torch.arange(K, device=DEV)[None, :] < nvis[:, None], idx + T, -1).int()
    ranges = torch.stack(((t - W + 1).clamp_min(0), t + 1, t * 0, t * 0), 1).int()
    return q, kv, idx, sink, ranges, int((ranges[:, 1] - ranges[:, 0]).sum() + (idx >= 0).sum())


def sweep(T=32768, H=64, D=512):
    """Time core configs on a CSA-shaped problem (window range + K gathered entries); keep the best."""
    from v4launch.model.kernels import triton_attention as ta
    from v4launch.model.kernels import triton_attention_bwd as tb

    q, kv, idx, sink, ranges, n = csa_problem(T, H, D)
    out = []
    for kind in ("fwd", "bwd", "bwd_dq"):
        best = None
        for cfg in SWEEP[kind] or (tb.DKV_CANDIDATES if kind == "bwd" else tb.DQ_CANDIDATES):
            try:
                if kind == "fwd":
                    cfg = {"BH": 64, **cfg}  # the kernel reads the head block too
                    ta.CONFIGS["fwd"]["lp"] = cfg
                    fn = lambda: ta.attention_fwd(q, kv, idx, sink, D ** -0.5, ranges)  # noqa: E731
                else:
                    tb.CONFIGS["dkv" if kind == "bwd" else "dq"] = cfg
                    o, lse = ta.attention_fwd(q, kv, idx, sink, D ** -0.5, ranges)
                    do = torch.randn_like(o)
                    fn = lambda: ta.attention_bwd(q, kv, idx, ranges, o, lse, do, D ** -0.5)  # noqa: E731
                fn()
                ms = cuda_time(fn, 3)
                tf = (4 if kind == "fwd" else 10) * H * D * n / ms / 1e9  # bwd_dq: whole backward
            except Exception as e:  # noqa: BLE001 - a config that does not compile / fit
                ms, tf = float("inf"), 0.0
                print("sweep", kind, cfg, "failed:", str(e).splitlines()[0][:120], flush=True)
            print(f"sweep {kind} {cfg}: {ms:.2f} ms {tf:.0f} TFLOP/s", flush=True)
            out.append(dict(kind=kind, cfg=cfg, ms=ms, tflops=tf))
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if kind == "fwd":
            ta.CONFIGS["fwd"]["lp"] = best[1]
        else:
            tb.CONFIGS["dkv" if kind == "bwd" else "dq"] = best[1]
        print(f"sweep {kind} best {best[1]} {best[0]:.2f} ms", flush=True)
    del q, kv
    torch.cuda.empty_cache()
    return out


def bwd_breakdown(sizes, peak, reps=3, H=64, D=512):
    """Where the two-pass backward's time goes on CSA-shaped problems, for each pass-1 kernel that
    runs here (Gluon, Triton): the whole backward, pass 1 alone, pass 1 without the dKV reductions
    of the index (top-k) tiles, pass 2 alone. Prints a markdown table; returns its rows."""
    from v4launch.model.kernels import triton_attention as ta
    from v4launch.model.kernels import triton_attention_bwd as tb

    rows = []
    print("| tokens | pass-1 kernel | backward ms | TFLOP/s (% peak) | pass 1 ms |"
          " pass 1 without top-k dKV reductions ms | their exposed cost ms | pass 2 ms |", flush=True)
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for T in sizes:
        q, kv, idx, sink, ranges, n = csa_problem(T, H, D)
        o, lse = ta.attention_fwd(q, kv, idx, sink, D ** -0.5, ranges)
        do = torch.randn_like(o)
        kernels = ("triton",) if tb.gluon_pass1_unavailable(q) else ("gluon", "triton")
        for kernel in kernels:
            ms = {}
            for name, kw in (("bwd", {}), ("pass1", dict(passes=("dkv",))),
                             ("pass1_no_idx_red", dict(passes=("dkv",), reduce_idx=False)),
                             ("pass2", dict(passes=("dq",)))):
                fn = lambda: tb.attention_bwd(q, kv, idx, ranges, o, lse, do, D ** -0.5,  # noqa: E731
                                              dkv_kernel=kernel, **kw)
                fn()
                ms[name] = cuda_time(fn, reps)
            tf = 10 * H * D * n / ms["bwd"] / 1e9
            r = dict(T=T, kernel=kernel, candidates=n, tflops=tf, **{f"{k}_ms": v for k, v in ms.items()})
            rows.append(r)
            print(f"| {T} | {kernel} | {ms['bwd']:.1f} | {tf:.0f} ({100 * tf / peak:.1f}%) | {ms['pass1']:.1f} | "
                  f"{ms['pass1_no_idx_red']:.1f} | {ms['pass1'] - ms['pass1_no_idx_red']:.1f} | "
                  f"{ms['pass2']:.1f} |", flush=True)
        del q, kv, o, do
        torch.cuda.empty_cache()
    return rows


def fmt(v, nd=1):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8192,32768,65536,131072")
    ap.add_argument("--ref-limit", type=float, default=25.0, help="skip a reference run predicted above N s")
    ap.add_argument("--kern-limit", type=float, default=20.0, help="skip a kernel-path run predicted above N s")
    ap.add_argument("--sdpa-limit", type=float, default=6.0)
    ap.add_argument("--parity-T", type=int, default=4096)
    ap.add_argument("--layers", default="all")
    ap.add_argument("--profile", default="", help="write a torch.profiler table of the CSA sparse layer here")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time core kernel configs first and keep the best")
    ap.add_argument("--sweep-only", action="store_true", help="run the sweep, print it and stop")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--no-fp32-parity", action="store_true")
    ap.add_argument("--bwd-breakdown", action="store_true",
                    help="time the two-pass backward's passes on CSA-shaped problems of --sizes and stop")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    reps = 1 if a.quick else 3
    import triton
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, python=platform.python_version(),
               commit=os.environ.get("V4_COMMIT") or subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                                  capture_output=True, text=True).stdout.strip())
    env["peak_tflops"] = matmul_peak()
    env["copy_gbs"] = copy_bw()
    print(json.dumps(env), flush=True)
    results = dict(env=env, parity=[], rows=[], sweep=[])
    if a.bwd_breakdown:
        results["bwd_breakdown"] = bwd_breakdown(sizes, env["peak_tflops"], reps)
        Path(a.out, "attention_bwd_breakdown.json").write_text(json.dumps(results, indent=1, default=str))
        return
    if a.sweep or a.sweep_only:
        results["sweep"] = sweep()
        if a.sweep_only:
            Path(a.out, "attention_sweep.json").write_text(json.dumps(results, indent=1, default=str))
            return
    from v4launch.model.kernels import triton_attention as ta
    from v4launch.model.kernels import triton_attention_bwd as tb
    env["configs"] = {k: v["lp"] for k, v in ta.CONFIGS.items()}
    env["configs"].update({f"bwd_two_pass_{k}": v for k, v in tb.CONFIGS.items()})
    if not a.no_parity:
        results["parity"] += parity(a.parity_T, torch.bfloat16, layers=a.layers)
        if not a.no_fp32_parity:
            results["parity"] += parity(1024, torch.float32, layers=a.layers)
    backend = select_backend("triton", DEV)
    assert backend.name == "triton", backend.reason
    layers = LAYERS if a.layers == "all" else [l for l in LAYERS if f"{l[0]}-{l[4]}" in a.layers.split(",")]
    last = {}
    for name, lid, ind, target, phase in layers:
        attn, args = make_layer(lid, ind)
        quad = name == "HCA" or phase in ("dense", "warmup")
        for T in sizes:
            row = dict(layer=name, phase=phase, T=T)
            pack = make_pack(torch.zeros(T, dtype=torch.long, device=DEV), torch.tensor([0, T], device=DEV), T)
            ctx_args = (pack, args.window_size, target, 256)
            x = torch.randn(T, args.dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn(T, args.dim, device=DEV)
            for path in ("kernels", "reference"):
                key = (name, phase, path)
                limit = a.kern_limit if path == "kernels" else a.ref_limit
                if key in last:
                    t0, T0 = last[key]
                    pred = t0 * (T / T0) ** (2 if quad else 1)
                    if pred > limit:
                        row[path] = f"skipped: predicted {pred:.0f} s > {limit:.0f} s"
                        continue
                cap = Capture(backend)
                be = cap.wrap()
                try:
                    n_rep = 1 if (path == "reference" or T > 65536) else reps
                    best = None
                    for i in range(n_rep + (1 if (path == "kernels" or T == sizes[0]) else 0)):
                        f_ms, b_ms, peak, _, _ = step(path, attn, x, g, ctx_args, be)
                        if i >= (1 if (path == "kernels" or T == sizes[0]) else 0):
                            best = (f_ms, b_ms, peak) if best is None or f_ms + b_ms < sum(best[:2]) else best
                    f_ms, b_ms, peak = best
                    row[path] = dict(fwd_ms=f_ms, bwd_ms=b_ms, ms=f_ms + b_ms, peak_gb=peak,
                                     tok_s=T / ((f_ms + b_ms) / 1e3))
                    last[key] = ((f_ms + b_ms) / 1e3, T)
                    if path == "kernels":
                        row.update(core_numbers(cap, 1 if T > 65536 else reps))
                except torch.OutOfMemoryError as e:
                    row[path] = f"OOM ({str(e).split('Tried to allocate')[-1][:20].strip()})"
                    last[key] = (1e9, T)
                del cap, be
                torch.cuda.empty_cache()
                print(name, phase, T, path, row[path] if isinstance(row[path], str) else
                      {k: round(v, 2) for k, v in row[path].items()}, flush=True)
            if isinstance(row.get("kernels"), dict) and isinstance(row.get("reference"), dict):
                row["speedup"] = row["reference"]["ms"] / row["kernels"]["ms"]
            if name == "CSA" and phase == "sparse" and a.profile and T == 65536:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    step("kernels", attn, x, g, ctx_args, backend)
                tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
                Path(a.profile).write_text(tab)
                print(tab[:6000], flush=True)
            results["rows"].append(row)
            dump(results, a.out)
            del x, g
            torch.cuda.empty_cache()
        del attn
        torch.cuda.empty_cache()
    for T in sizes:
        key = ("sdpa",)
        if key in last and last[key][0] * (T / last[key][1]) ** 2 > a.sdpa_limit:
            results["rows"].append(dict(layer="SDPA dense causal", phase="-", T=T,
                                        sdpa=f"skipped: predicted {last[key][0] * (T / last[key][1]) ** 2:.0f} s"))
            continue
        try:
            ms, tf = sdpa_time(T, 64, 512, 1 if T > 16384 else reps)
            last[key] = (ms / 1e3, T)
            results["rows"].append(dict(layer="SDPA dense causal", phase="-", T=T, sdpa=dict(ms=ms, tflops=tf,
                                                                                              tok_s=T / ms * 1e3)))
        except Exception as e:  # noqa: BLE001 - record why SDPA cannot run this shape
            results["rows"].append(dict(layer="SDPA dense causal", phase="-", T=T, sdpa=f"error: {str(e)[:80]}"))
            break
        torch.cuda.empty_cache()
    print(dump(results, a.out))


def dump(results, out):
    md = render(results)
    Path(out, "attention_results.json").write_text(json.dumps(results, indent=1, default=str))
    Path(out, "attention_table.md").write_text(md)
    return md


def render(res):
    env = res["env"]
    pk = env["peak_tflops"]
    L = [f"GPU {env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
         f"commit {env['commit']}. Measured bf16 matmul peak {pk:.0f} TFLOP/s, copy {env['copy_gbs']:.2f} TB/s.",
         "", "| layer | phase | tokens | kernels fwd+bwd ms | tok/s | peak GB | reference fwd+bwd ms | peak GB | speedup |"
         " core fwd TFLOP/s (% peak) | core bwd TFLOP/s (% peak) | indexer score TFLOP/s (% peak) | indexer+top-k ms |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "sdpa" in r:
            s = r["sdpa"]
            L.append(f"| SDPA dense causal MQA | - | {r['T']} | " + (f"{s['ms']:.1f} | {s['tok_s']:.0f} | | | | | "
                     f"{s['tflops']:.0f} ({100 * s['tflops'] / pk:.0f}%) fwd+bwd | | | |" if isinstance(s, dict)
                     else f"{s} | | | | | | | | | |"))
            continue
        k, ref = r.get("kernels"), r.get("reference")
        kc = (f"{k['ms']:.1f} | {k['tok_s']:.0f} | {k['peak_gb']:.1f}" if isinstance(k, dict) else f"{k} | | ")
        rc = (f"{ref['ms']:.0f} | {ref['peak_gb']:.1f}" if isinstance(ref, dict) else f"{ref} | ")
        sp = f"{r['speedup']:.1f}x" if "speedup" in r else "-"
        cf = (f"{r['core_fwd_tflops']:.0f} ({100 * r['core_fwd_tflops'] / pk:.0f}%)" if "core_fwd_tflops" in r else "-")
        cb = (f"{r['core_bwd_tflops']:.0f} ({100 * r['core_bwd_tflops'] / pk:.0f}%)" if "core_bwd_tflops" in r else "-")
        ix = (f"{r['idx_score_tflops']:.0f} ({100 * r['idx_score_tflops'] / pk:.0f}%)" if "idx_score_tflops" in r else "-")
        it = f"{r['idx_topk_ms']:.1f}" if "idx_topk_ms" in r else "-"
        L.append(f"| {r['layer']} | {r['phase']} | {r['T']} | {kc} | {rc} | {sp} | {cf} | {cb} | {ix} | {it} |")
    L += ["", "Parity, kernel path vs reference path (relative L2 error; bf16 limit 1e-2, fp32 limit 1e-4):", "",
          "| layer | phase | dtype | tokens | out | kl | worst grad (tensor) | kernels vs fp32 truth: out / worst grad |"
          " reference bf16 vs fp32 truth: out / worst grad | ok |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in res["parity"]:
        L.append(f"| {p['layer']} | {p['phase']} | {p['dtype']} | {p['T']} | {p['out']:.1e} | "
                 f"{p.get('kl', float('nan')):.1e} | {p['grad(max)']:.1e} ({p['worst_grad']}) | " +
                 (f"{p['kern_vs_fp32']['out']:.1e} / {p['kern_vs_fp32']['grad(max)']:.1e} ({p['kern_vs_fp32_worst']}) | "
                  f"{p['ref_vs_fp32']['out']:.1e} / {p['ref_vs_fp32']['grad(max)']:.1e} ({p['ref_vs_fp32_worst']}) | "
                  if "kern_vs_fp32" in p else "- | - | ") + f"{p['ok']} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
