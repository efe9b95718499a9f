"""Sweep the sparse-attention backward's tile config for head counts below 64 (one SM90 GPU).

    python benchmarks/attention_bwd_sweep_small_heads.py --heads 16 --out $OUT
    python benchmarks/attention_bwd_sweep_small_heads.py --heads 16 --two-pass --out $OUT
    python benchmarks/attention_bwd_sweep_small_heads.py --heads 16 --query-blocks --out $OUT

Single-pass (default): the kernel ``triton_attention._sparse_bwd`` with ``CONFIGS["bwd"]["lp_h16"]`` (<= 16
heads) or ``["lp"]``. ``--two-pass``: ``triton_attention_bwd`` with one head block of 16 / 32 heads
(``head_block``) for each pass-1 config in ``DKV_CANDIDATES`` and pass-2 config in ``DQ_CANDIDATES``, and the
single-pass kernel's current config as the first row, so the table says which backward to dispatch.
``--query-blocks``: the backward as dispatched (``triton_attention.attention_bwd`` given the layer's
``range_bounds``) with ``QUERY_BLOCK_BACKWARD`` off, then on at each config in ``QUERY_BLOCK_CONFIGS``
(``triton_attention_query_blocks``: blocks of 64 / H queries over the ranges; CSA's top-k columns as a masked
span of a segment's entries, ``csa``, or with no span bound in the single pass, ``csa_split``): CSA, HCA and SWA
as the sparse phase runs them and CSA in the dense phase
(``csa_dense``: the window and every visible ratio-4 entry as ranges), with the saving per sparse step
(4 CSA + 3 HCA + 2 SWA) and per dense step (4 dense CSA + 3 HCA + 2 SWA). This
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
    ratio = {"csa": 4, "csa_dense": 4, "hca": 128, "swa": 0}[kind]
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
        if kind in ("hca", "csa_dense"):  # every visible entry as a range (CSA's dense phase selects no top-k)
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


TIME_COLUMNS = [("csa ms", 7, lambda r: f"{r['ms']['csa']:.2f}"), ("hca ms", 7, lambda r: f"{r['ms']['hca']:.2f}"),
                ("swa ms", 7, lambda r: f"{r['ms']['swa']:.2f}"), ("per step ms", 11, lambda r: f"{r['step_ms']:.2f}")]


def print_table(title: str, rows: list[dict], columns: list) -> None:
    """The rows that ran, fastest per step first, under ``title``; ``columns``: (header, width, cell(row)) with
    a negative width for left-aligned (text) columns."""
    print(f"\n{title}")
    print(" ".join(f"{h:<{-w}}" if w < 0 else f"{h:>{w}}" for h, w, _ in columns))
    for r in sorted((r for r in rows if "step_ms" in r), key=lambda r: r["step_ms"]):
        print(" ".join(f"{c(r):<{-w}.{-w}}" if w < 0 else f"{c(r):>{w}}" for _, w, c in columns))


def measure(row: dict, bwd, problems: dict, truth: dict, scale: float, reps: int) -> dict:
    """Fill ``row`` with one backward's error against ``truth`` (the largest relative dq / dkv error over the
    layers), its ms per layer and per benchmark step (``LAYERS``-weighted); an exception (out of shared memory
    or registers) is recorded as ``row["error"]``, not raised. Prints the row as JSON and returns it."""
    try:
        for kind, p in problems.items():
            dq, dkv, _ = bwd(*p, scale)
            row["err"] = max(row["err"], rel(dq, truth[kind][0]), rel(dkv, truth[kind][1]))
            row["ms"][kind] = timed(lambda: bwd(*p, scale), reps)
        row["step_ms"] = sum(LAYERS[k] * row["ms"][k] for k in LAYERS)
    except Exception as e:  # out of shared memory / registers: reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
    print(json.dumps(row), flush=True)
    return row


def sweep_two_pass(a, problems: dict, truth: dict, current: dict, scale: float, D: int) -> None:
    """``--two-pass``: the single-pass kernel's current config, then every pass-1 x pass-2 config of
    ``triton_attention_bwd`` at one small head block; prints the table, writes attention_bwd_two_pass_h<H>.json."""
    from v4launch.model.kernels import triton_attention_bwd as tb

    saved, rows = dict(tb.CONFIGS), []
    rows.append(measure(dict(kernel="single-pass", dkv=current, dq=None, ms={}, err=0.0),
                        ta.attention_bwd_single_pass, problems, truth, scale, a.reps))
    for c1, c2 in itertools.product(tb.DKV_CANDIDATES, tb.DQ_CANDIDATES):
        tb.CONFIGS.update(dkv=c1, dq=c2)
        rows.append(measure(dict(kernel="two-pass", dkv=c1, dq=c2, ms={}, err=0.0),
                            lambda *p: tb.attention_bwd(*p, dkv_kernel="triton"), problems, truth, scale, a.reps))
    tb.CONFIGS.update(saved)
    print_table(f"backward, {a.heads} heads x {D}, {a.tokens} tokens as {a.tokens // a.seg} x {a.seg}; "
                f"{torch.cuda.get_device_name()}; error vs the single-pass kernel's current config", rows,
                [("kernel", -12, lambda r: r["kernel"]), ("pass 1", -34, lambda r: str(r["dkv"]) if r["dq"] else "-"),
                 ("pass 2", -30, lambda r: str(r["dq"] or "-")), *TIME_COLUMNS, ("err", 8, lambda r: f"{r['err']:.1e}")])
    with open(os.path.join(a.out, f"attention_bwd_two_pass_h{a.heads}.json"), "w") as f:
        json.dump(dict(heads=a.heads, gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                  indent=1)


QUERY_BLOCK_CONFIGS = [dict(BN=BN, NP=NP, num_warps=w, num_stages=1, BNQ=BNQ, dq_form=form, dq_warps=dw,
                            dq_stages=2)
                       for BN, NP, w, BNQ, form, dw in ((64, 4, 8, 64, "query", 4), (64, 4, 4, 64, "query", 4),
                                                        (128, 4, 8, 64, "query", 4), (64, 2, 8, 64, "query", 4),
                                                        (64, 4, 8, 32, "query", 4), (64, 4, 8, 64, "block", 8),
                                                        (64, 4, 8, 32, "block", 8), (128, 4, 8, 64, "block", 8))]


def sweep_query_blocks(a, D: int, scale: float, gen: torch.Generator) -> None:
    """``--query-blocks``: ``triton_attention.attention_bwd`` given the layers' ``range_bounds`` with
    ``QUERY_BLOCK_BACKWARD`` off (the single pass), then on at each of ``QUERY_BLOCK_CONFIGS``; prints the table,
    writes attention_bwd_query_blocks_h<H>.json."""
    from v4launch.model.kernels import triton_attention_query_blocks as tqb

    kinds, problems = ("csa", "csa_split", "hca", "swa", "csa_dense"), {}
    for kind in kinds:
        q, kv, idx, ranges = layer_problem(kind.removesuffix("_split"), a.tokens, a.seg, a.heads, D, 128, 512, gen)
        out, lse = ta.attention_fwd(q, kv, idx, torch.zeros(a.heads, device="cuda"), scale, ranges)
        # the longest window and entry range (the layer states them from its plan; here read off the ranges);
        # sparse CSA: the span of the top-k columns bounded by a segment's entries (the layer's plan.max_entries),
        # csa_split: no span bound, so the columns stay in the single pass
        bounds = tuple(int((ranges[:, 2 * r + 1] - ranges[:, 2 * r]).clamp_min(0).max()) for r in range(2))
        if kind == "csa":
            bounds = (bounds[0], a.seg // 4)
        problems[kind] = (q, kv, idx, ranges, out, lse, torch.randn_like(out), bounds)

    def bwd(p):
        return ta.attention_bwd(*p[:7], scale, range_bounds=p[7])

    saved, rows = (dict(tqb.CONFIG), ta.QUERY_BLOCK_BACKWARD, ta.SPAN_PER_COLUMN), []
    ta.SPAN_PER_COLUMN = 2  # csa: the columns as a masked span (csa_split: no span bound, the single pass)
    ta.QUERY_BLOCK_BACKWARD = False
    truth = {k: bwd(p) for k, p in problems.items()}
    single = {k: timed(lambda p=p: bwd(p), a.reps) for k, p in problems.items()}
    rows.append(dict(kernel="single-pass", cfg=None, ms=single, err=0.0))
    ta.QUERY_BLOCK_BACKWARD = True
    for cfg in QUERY_BLOCK_CONFIGS:
        tqb.CONFIG.update(cfg)
        row = dict(kernel="query-blocks", cfg=cfg, ms={}, err=0.0)
        try:
            for k, p in problems.items():
                dq, dkv, _ = bwd(p)
                row["err"] = max(row["err"], rel(dq, truth[k][0]), rel(dkv, truth[k][1]))
                row["ms"][k] = timed(lambda p=p: bwd(p), a.reps)
        except Exception as e:  # out of shared memory / registers: reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    tqb.CONFIG.update(saved[0])
    ta.QUERY_BLOCK_BACKWARD, ta.SPAN_PER_COLUMN = saved[1:]
    for r in rows:
        if len(r["ms"]) == len(kinds):
            both = sum(n * (single[k] - r["ms"][k]) for k, n in (("hca", 3), ("swa", 2)))
            r["sparse_saving_ms"] = both + 4 * (single["csa"] - r["ms"]["csa"])
            r["dense_saving_ms"] = both + 4 * (single["csa_dense"] - r["ms"]["csa_dense"])
            r["step_ms"] = -r["sparse_saving_ms"]  # print_table sorts by it: the largest sparse-step saving first
    print_table(f"attention backward, {a.heads} heads x {D}, {a.tokens} tokens as {a.tokens // a.seg} x {a.seg}; "
                f"{torch.cuda.get_device_name()}; saving per benchmark step against the single-pass kernel", rows,
                [("kernel", -12, lambda r: r["kernel"]), ("config", -40, lambda r: str(r["cfg"] or "-")),
                 *[(f"{k} ms", max(7, len(k) + 3), lambda r, k=k: f"{r['ms'][k]:.2f}") for k in kinds],
                 ("sparse save", 11, lambda r: f"{r['sparse_saving_ms']:.2f}"),
                 ("dense save", 10, lambda r: f"{r['dense_saving_ms']:.2f}"), ("err", 8, lambda r: f"{r['err']:.1e}")])
    with open(os.path.join(a.out, f"attention_bwd_query_blocks_h{a.heads}.json"), "w") as f:
        json.dump(dict(heads=a.heads, gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                  indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seg", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--two-pass", action="store_true", help="time the two-pass backward's configs instead")
    ap.add_argument("--query-blocks", action="store_true", help="time the query-block backward on the range-only "
                    "layers instead")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    D, scale = 512, 512 ** -0.5
    if a.query_blocks:
        sweep_query_blocks(a, D, scale, gen)
        return
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
    if a.two_pass:
        sweep_two_pass(a, problems, truth, current, scale, D)
        return
    rows = []
    grid = [c for c in itertools.product((16, 32, 64), (1, 2, 4), (4, 8)) if c[:2] != (64, 1)]
    for BN, n_split, warps in grid:
        stages = 1
        cfg = dict(BN=BN, n_split=n_split, BH=64, num_warps=warps, num_stages=stages)
        ta.CONFIGS["bwd"][key] = cfg
        rows.append(measure(dict(cfg, ms={}, err=0.0), ta.attention_bwd_single_pass, problems, truth, scale, a.reps))
    ta.CONFIGS["bwd"][key] = current
    print_table(f"single-pass backward, {a.heads} heads x {D}, {a.tokens} tokens as {a.tokens // a.seg} x {a.seg}; "
                f"{torch.cuda.get_device_name()}; current config {current}", rows,
                [("BN", 3, lambda r: str(r["BN"])), ("split", 5, lambda r: str(r["n_split"])),
                 ("warps", 5, lambda r: str(r["num_warps"])), ("stages", 6, lambda r: str(r["num_stages"])),
                 *TIME_COLUMNS, ("err vs current", 14, lambda r: f"{r['err']:.1e}")])
    with open(os.path.join(a.out, f"attention_bwd_sweep_h{a.heads}.json"), "w") as f:
        json.dump(dict(heads=a.heads, current=current, gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
