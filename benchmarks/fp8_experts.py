"""The routed experts' MLP on one GPU at Flash width: bf16 grouped GEMMs against the FP8 paths.

    python benchmarks/fp8_experts.py --json $OUT/fp8_experts.json                # one H100/H200, ~1 minute
    python benchmarks/fp8_experts.py --profile                                   # + GPU time per kernel class

One row = the MLP ``w2(swiglu(w1 x, w3 x))`` of the experts one EP rank holds, over the rows they receive,
forward and backward, the gradients of x and of the stacked weights; bf16 inputs, SwiGLU clamp 10 as in the recipe.
Default: flash_4n's 8 local experts (256 over EP32), dim 4096, inter 2048, and 393,216 rows = one 65,536-token
sequence x top-6 (flash_width.py's convention: the rows of a CP=1 rank; flash_4n itself runs cp 4, whose ranks hold
16,384 tokens and receive ~98K rows). Row counts per expert are drawn from a multinomial around the balanced split
(``--rows`` small enough can leave an expert without rows). Variants (``--variants``; default all):

  bf16            ``moe.run_local_experts(fp8=False)``: three ``torch._grouped_mm`` (the default path)
  fp8 torchao     torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` per weight (w1, w3, w2), the SwiGLU between
                  as the product's compiled region, each expert's rows padded to 16 first (torchao's FP8 weight
                  gradient needs it; the padding copy and the gather back are timed with it): the path before
                  ``model/fp8_experts.py``
  fp8             ``moe.run_local_experts(fp8=True)``: ``fp8_experts.fp8_expert_mlp`` (e4m3 forward and input
                  gradients, w1 and w3 as one GEMM, the casts fused into the SwiGLU regions, bf16 weight gradients)

Columns: forward ms (under ``torch.no_grad``), forward + backward ms (each the median of ``--iters`` after
``--warmup``, CUDA events), the speed-up of forward + backward over bf16, TFLOP/s (the three GEMMs' FLOPs x 3 for
forward + backward over the fwd+bwd time). ``--profile``: one profiled iteration per variant, GPU time in GEMM
kernels and in everything else.
Raises: SystemExit without a CUDA device of compute capability 9.0+.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("bf16", "fp8 torchao", "fp8")


def _counts(rows: int, experts: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    counts = torch.multinomial(torch.full((experts,), 1.0 / experts), rows, replacement=True, generator=gen)
    return torch.bincount(counts, minlength=experts)


def _variants(experts, limit):
    import torch

    from v4launch.model import regions
    from v4launch.model.moe import run_local_experts, swiglu

    def pad_groups(x, counts, align):  # torchao's FP8 weight gradient needs every group at a multiple of 16 rows
        padded = (counts + align - 1) // align * align
        ends = torch.cumsum(padded, 0, dtype=torch.int32)
        group = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
        starts, pstarts = torch.cumsum(counts, 0) - counts, ends - padded
        dest = pstarts[group] + torch.arange(x.shape[0], device=x.device) - starts[group]
        return x.new_zeros(int(ends[-1]), x.shape[1]).index_copy(0, dest, x), dest, ends

    def torchao_path(x, counts):
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as mm

        def stacked(name):
            return torch.stack([getattr(e, name).weight for e in experts]).transpose(-2, -1)

        xp, dest, ends = pad_groups(x, counts, 16)
        kw = dict(out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
        h = swiglu(mm(xp, stacked("w1"), ends, **kw), mm(xp, stacked("w3"), ends, **kw), limit, torch.bfloat16)
        return mm(h, stacked("w2"), ends, **kw)[dest]

    assert regions.fused_here(experts[0].w1.weight)
    return {
        "bf16": lambda x, counts: run_local_experts(experts, x, counts, grouped=True, fp8=False),
        "fp8 torchao": torchao_path,
        "fp8": lambda x, counts: run_local_experts(experts, x, counts, grouped=True, fp8=True),
    }


def _time(fn, iters, warmup):
    """Median ms of ``iters`` calls of fn after ``warmup`` untimed ones (attention.cuda_time: CUDA events)."""
    from attention import cuda_time  # noqa: PLC0415  (imports torch: the GPU run only)

    for _ in range(warmup):
        fn()
    return cuda_time(fn, iters)


def _profile(fn):
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    gemm = other = 0.0
    top: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        ms = ev.device_time / 1e3 if hasattr(ev, "device_time") else ev.cuda_time / 1e3
        name = ev.name
        if any(k in name.lower() for k in ("gemm", "cutlass", "sm90", "grouped_mm", "nvjet")):
            gemm += ms
        else:
            other += ms
        top[name[:90]] = top.get(name[:90], 0.0) + ms
    return gemm, other, sorted(top.items(), key=lambda kv: -kv[1])[:8]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=393216, help="routed rows the rank's experts receive")
    p.add_argument("--experts", type=int, default=8, help="local experts")
    p.add_argument("--dim", type=int, default=4096, help="model dim (the experts' input and output width)")
    p.add_argument("--inter", type=int, default=2048, help="moe_inter_dim")
    p.add_argument("--limit", type=float, default=10.0, help="SwiGLU clamp (0 = none)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    p.add_argument("--variants", nargs="*", default=None, choices=VARIANTS, metavar="VARIANT",
                   help=f"any of {', '.join(repr(v) for v in VARIANTS)} (default: all)")
    p.add_argument("--profile", action="store_true", help="one profiled iteration per variant: GEMM vs other kernels")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("fp8_experts.py needs a CUDA device of compute capability 9.0+ (torch._scaled_grouped_mm)")
    from v4launch.model.moe import Expert

    torch.manual_seed(0)
    experts = [Expert(args.dim, args.inter, args.limit).cuda().bfloat16() for _ in range(args.experts)]
    for e in experts:
        for lin in (e.w1, e.w2, e.w3):
            torch.nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
    counts = _counts(args.rows, args.experts, 0).cuda()
    x = torch.randn(args.rows, args.dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(args.rows, args.dim, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * args.rows * args.dim * args.inter * 3 * 3
    variants = _variants(experts, args.limit)
    chosen = args.variants or list(variants)
    name = torch.cuda.get_device_name()
    print(f"{name}: {args.experts} experts, {args.rows} rows, dim {args.dim}, inter {args.inter}; "
          f"torch {torch.__version__}")
    print(f"{'variant':<16}{'fwd ms':>9}{'fwd+bwd ms':>12}{'vs bf16':>9}{'TFLOP/s':>9}")
    rows, base = [], None
    for key in chosen:
        fn = variants[key]

        def fwd():
            with torch.no_grad():
                fn(x, counts)

        def step():
            x.grad = None
            for e in experts:
                e.zero_grad(set_to_none=True)
            fn(x, counts).backward(dy)

        f_ms, s_ms = _time(fwd, args.iters, args.warmup), _time(step, args.iters, args.warmup)
        base = base or (s_ms if key == "bf16" else None)
        row = {"variant": key, "fwd_ms": f_ms, "step_ms": s_ms, "tflops": flops / s_ms / 1e9,
               "speedup": (base / s_ms) if base else None}
        if args.profile:
            gemm, other, top = _profile(step)
            row.update(gemm_ms=gemm, other_ms=other, top=top)
        rows.append(row)
        speed = f"{row['speedup']:.3f}x" if row["speedup"] else "-"
        print(f"{key:<16}{f_ms:>9.2f}{s_ms:>12.2f}{speed:>9}{row['tflops']:>9.1f}")
    if args.profile:
        for row in rows:
            print(f"\nprofile {row['variant']}: GEMM kernels {row['gemm_ms']:.2f} ms, other {row['other_ms']:.2f} ms")
            for kname, ms in row["top"]:
                print(f"  {ms:8.2f}  {kname}")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "args": vars(args) | {
            "json": str(args.json)}, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
