"""Sweep the sparse-attention backward's tile config for head counts below 64 (one SM90 GPU).

    python benchmarks/attention_bwd_sweep_small_heads.py --heads 16 --out $OUT
    python benchmarks/attention_bwd_sweep_small_heads.py --heads 16 --two-pass --out $OUT

Single-pass (default): the kernel ``triton_attention._sparse_bwd`` with ``CONFIGS["bwd"]["lp_h16"]`` (<= 16
heads) or ``["lp"]``. ``--two-pass``: ``triton_attention_bwd`` with one head block of 16 / 32 heads
(``head_block``) for each pass-1 config in ``DKV_CANDIDATES`` and pass-2 config in ``DQ_CANDIDATES``, and the
single-pass kernel's current config as the first row, so the table says which backward to dispatch. This
times it at the benchmark model's layers (benchmarks/train_step.py: 8,192 tokens as 2 x 4,096, D 512,
window 128; CSA: top-512 of the compress-ratio-4 entries; HCA: every ratio-128 entry; SWA: the window
alone) for each candidate config, weighted by the layer counts (4 CSA, 3 HCA, 2 SWA with the MTP
block), checks each config's dq / dkv against the current config's (same inputs), and prints a table,
best first; ``--json`` keeps it. Nothing is changed in the package: the winner is written into
``CONFIGS`` by hand, with the table under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from v4launch.model.kernels import triton_attention as ta

LAYERS = {"csa": 4, "hca": 3, "swa": 2}  # the benchmark model's layers, MTP block included (SWA)


def layer_problem(kind: str, T: int, seg: int, H: int, D: int, window: int, topk: int, gen: torch.Generator,
                  device: str = "cuda"):
    """q [T, H, D], kv [T + C, D] (window rows, then compressed entries), idx [T, K] | None, ranges [T, 4]."""
    ratio = {"csa": 4, "hca": 128, "swa": 0}[kind]
    n_seg = T // seg
    C = n_seg * (seg // ratio) if ratio else 0
    t = torch.arange(T)
    pos = t % seg
    lo = t - torch.clamp(pos, max=window - 1)
    ranges = torch.stack((lo, t + 1, torch.zeros_like(t), torch.zeros_like(t)), 1)
    idx = None
    if ratio:
        first = T + (t // seg) * (seg // ratio)  # this segment's first compressed entry (kv row)
        visible = (pos + 1) // ratio
        if kind == "hca":
            ranges[:, 2], ranges[:, 3] = first, first + visible
        else:
            K = topk
            scores = torch.rand(T, seg // ratio, generator=gen)
            scores[torch.arange(seg // ratio)[None, :] >= visible[:, None]] = -1.0
            top = scores.topk(K, dim=1)
            idx = torch.where(top.values >= 0, first[:, None] + top.indices, -1).int()
    q = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    kv = (torch.randn(T + C, D, generator=gen) * 0.5).to(torch.bfloat16)
    return q.to(device), kv.to(device), (idx.to(device) if idx is not None else None), ranges.int().to(device)


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seg", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--two-pass", action="store_true", help="time the two-pass backward's configs instead")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    D, scale = 512, 512 ** -0.5
    problems = {}
    for kind in LAYERS:
        q, kv, idx, ranges = layer_problem(kind, a.tokens, a.seg, a.heads, D, 128, 512, gen)
        sink = torch.zeros(a.heads, device="cuda")
        out, lse = ta.attention_fwd(q, kv, idx, sink, scale, ranges)
        dout = torch.randn_like(out)
        problems[kind] = (q, kv, idx, ranges, out, lse, dout)
    key = "lp_h16" if a.heads <= 16 else "lp"  # the config attention_bwd_single_pass reads for bf16
    current = dict(ta.CONFIGS["bwd"][key])
    truth = {k: ta.attention_bwd_single_pass(*p, scale) for k, p in problems.items()}
    rows = []
    if a.two_pass:
        from v4launch.model.kernels import triton_attention_bwd as tb

        saved = dict(tb.CONFIGS)
        variants = [("single-pass", current, None)] + [
            ("two-pass", c1, c2) for c1 in tb.DKV_CANDIDATES for c2 in tb.DQ_CANDIDATES]
        for name, c1, c2 in variants:
            if c2 is not None:
                tb.CONFIGS.update(dkv=c1, dq=c2)
                bwd = lambda *p: tb.attention_bwd(*p, dkv_kernel="triton")  # noqa: E731
            else:
                bwd = ta.attention_bwd_single_pass
            row = dict(kernel=name, dkv=c1, dq=c2, ms={}, err=0.0)
            try:
                for kind, p in problems.items():
                    dq, dkv, _ = bwd(*p, scale)
                    row["err"] = max(row["err"], rel(dq, truth[kind][0]), rel(dkv, truth[kind][1]))
                    row["ms"][kind] = timed(lambda: bwd(*p, scale), a.reps)
                row["step_ms"] = sum(LAYERS[k] * row["ms"][k] for k in LAYERS)
            except Exception as e:  # out of shared memory / registers: reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        tb.CONFIGS.update(saved)
        ok = sorted((r for r in rows if "step_ms" in r), key=lambda r: r["step_ms"])
        print(f"\nbackward, {a.heads} heads x {D}, {a.tokens} tokens as {a.tokens // a.seg} x {a.seg}; "
              f"{torch.cuda.get_device_name()}; error vs the single-pass kernel's current config")
        print(f"{'kernel':<12} {'pass 1':<34} {'pass 2':<30} {'csa ms':>7} {'hca ms':>7} {'swa ms':>7} "
              f"{'per step ms':>11} {'err':>8}")
        for r in ok:
            print(f"{r['kernel']:<12} {str(r['dkv'] if r['dq'] else '-'):<34.34} {str(r['dq'] or '-'):<30.30} "
                  f"{r['ms']['csa']:>7.2f} {r['ms']['hca']:>7.2f} {r['ms']['swa']:>7.2f} {r['step_ms']:>11.2f} "
                  f"{r['err']:>8.1e}")
        with open(os.path.join(a.out, f"attention_bwd_two_pass_h{a.heads}.json"), "w") as f:
            json.dump(dict(heads=a.heads, gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                      indent=1)
        return
    grid = [c for c in itertools.product((16, 32, 64), (1, 2, 4), (4, 8)) if c[:2] != (64, 1)]
    for BN, n_split, warps in grid:
        stages = 1
        cfg = dict(BN=BN, n_split=n_split, BH=64, num_warps=warps, num_stages=stages)
        ta.CONFIGS["bwd"][key] = cfg
        row = dict(cfg, ms={}, err=0.0)
        try:
            for kind, p in problems.items():
                dq, dkv, _ = ta.attention_bwd_single_pass(*p, scale)
                row["err"] = max(row["err"], rel(dq, truth[kind][0]), rel(dkv, truth[kind][1]))
                row["ms"][kind] = timed(lambda: ta.attention_bwd_single_pass(*p, scale), a.reps)
            row["step_ms"] = sum(LAYERS[k] * row["ms"][k] for k in LAYERS)
        except Exception as e:  # out of shared memory / registers: reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    ta.CONFIGS["bwd"][key] = current
    ok = sorted((r for r in rows if "step_ms" in r), key=lambda r: r["step_ms"])
    print(f"\nsingle-pass backward, {a.heads} heads x {D}, {a.tokens} tokens as {a.tokens // a.seg} x {a.seg}; "
          f"{torch.cuda.get_device_name()}; current config {current}")
    print(f"{'BN':>3} {'split':>5} {'warps':>5} {'stages':>6} {'csa ms':>7} {'hca ms':>7} {'swa ms':>7} "
          f"{'per step ms':>11} {'err vs current':>14}")
    for r in ok:
        print(f"{r['BN']:>3} {r['n_split']:>5} {r['num_warps']:>5} {r['num_stages']:>6} {r['ms']['csa']:>7.2f} "
              f"{r['ms']['hca']:>7.2f} {r['ms']['swa']:>7.2f} {r['step_ms']:>11.2f} {r['err']:>14.1e}")
    with open(os.path.join(a.out, f"attention_bwd_sweep_h{a.heads}.json"), "w") as f:
        json.dump(dict(heads=a.heads, current=current, gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
