"""The routed experts under expert parallelism, dispatch + MLP + combine, with bf16 rows on the wire or e4m3 ones.

    python benchmarks/ep_exchange.py --gpus 8 --json $OUT/ep_exchange.json    # one node of 8 GPUs (NCCL)
    python benchmarks/ep_exchange.py --device cpu --gpus 2 --rows 512 --dim 64 --inter 32 --experts-per-rank 2
                                                                               # gloo, emulated e4m3: a smoke test

Each of ``--gpus`` ranks (one process per GPU, spawned here) holds ``--experts-per-rank`` routed experts and sends
``--rows`` rows of ``--dim`` (its tokens x top-k, routed uniformly over all experts) through one MoE layer's
exchange, forward and backward:

  bf16          ``ExpertParallelDispatch.dispatch`` -> ``run_local_experts(fp8=False)`` -> ``combine``
  fp8 experts   the same exchange, the experts on the FP8 MLP (``precision.fp8_dispatch: false``)
  fp8 exchange  ``ExpertParallelDispatch.fp8_experts``: the rows into the experts as e4m3 plus a scale per row,
                forward and backward (``precision.fp8_dispatch: true``, the default under FP8)

Defaults: flash_4n's rank at cp 4 (16,384 tokens x top-6 = 98,304 rows, dim 4096, inter 2048, 8 experts a rank).
Columns: milliseconds of forward + backward (the slowest rank's median over ``--iters`` after ``--warmup``; CUDA
events, or wall time on the CPU), the bytes one rank sends to the others per iteration (its rows spread evenly:
out and back, forward and backward; the e4m3 way in is dim + 4 bytes a row, as tests/model/ep checks) and the
speed-up over ``fp8 experts``. Within one node the all-to-all runs over
NVLink; flash_4n's EP32 spans 4 nodes, where 24 of 31 peers are behind the slower inter-node link, so the time
plan's saving (``time_plan.ep_row_bytes``) is larger than one node shows.
Raises: SystemExit when ``--device cuda`` has fewer than ``--gpus`` GPUs, or no SM90 GPU (the e4m3 grouped GEMM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("bf16", "fp8 experts", "fp8 exchange")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpus", type=int, default=8, help="ranks of the EP group (one process each)")
    p.add_argument("--rows", type=int, default=98_304, help="rows each rank sends (its tokens x top-k)")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--inter", type=int, default=2048, help="moe_inter_dim")
    p.add_argument("--experts-per-rank", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def _rank(rank: int, a: argparse.Namespace, store: str) -> None:
    import torch
    import torch.distributed as dist

    from v4launch.model.moe import Expert, fp8_weight_stacks, run_local_experts
    from v4launch.model.parallel import ExpertParallelDispatch

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=a.gpus)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    n_experts = a.gpus * a.experts_per_rank
    gen = torch.Generator().manual_seed(1000 + rank)
    experts = [Expert(a.dim, a.inter, 10.0).to(device=device, dtype=dtype) for _ in range(a.experts_per_rank)]
    choice = torch.randint(n_experts, (a.rows,), generator=gen)
    counts = torch.bincount(choice, minlength=n_experts).to(device)
    x = torch.randn(a.rows, a.dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(a.rows, a.dim, generator=gen).to(device=device, dtype=dtype)
    dispatcher = ExpertParallelDispatch(dist.group.WORLD, a.gpus, rank, n_experts)

    def exchange(fp8: bool):
        def run():
            x_local, local_counts, ctx = dispatcher.dispatch(x, counts)
            return dispatcher.combine(run_local_experts(experts, x_local, local_counts, grouped=True, fp8=fp8), ctx)
        return run

    def fp8_exchange():
        w13, w2 = fp8_weight_stacks(experts, dtype)
        return dispatcher.fp8_experts(x, counts, w13, w2, experts[0].limit)

    runs = {"bf16": exchange(False), "fp8 experts": exchange(True), "fp8 exchange": fp8_exchange}
    # bytes this rank sends to the others per iteration (rows spread evenly): out and back, forward and backward
    peers = (a.gpus - 1) / a.gpus
    row_bytes = {"bf16": 4 * a.dim * 2, "fp8 experts": 4 * a.dim * 2, "fp8 exchange": 2 * (a.dim + 4) + 2 * a.dim * 2}

    results = {}
    for name in a.variants.split(","):
        times = []
        for i in range(a.warmup + a.iters):
            dist.barrier()
            t0 = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            runs[name]().backward(dy)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            x.grad = None
            for e in experts:
                e.zero_grad(set_to_none=True)
            if i >= a.warmup:
                times.append(ms)
        slowest = torch.tensor(statistics.median(times), device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[name] = {"ms": slowest.item(), "wire_bytes": round(a.rows * row_bytes[name] * peers)}
    if rank == 0:
        _report(a, results, torch)
    dist.destroy_process_group()


def _report(a, results, torch) -> None:
    base = results.get("fp8 experts", {}).get("ms")
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (gloo)"
    print(f"{a.gpus} x {device}: {a.rows:,} rows of dim {a.dim} per rank, {a.experts_per_rank} experts a rank, "
          f"inter {a.inter}; torch {torch.__version__}")
    print(f"{'variant':14s} {'fwd+bwd ms':>11s} {'sent MB/rank':>13s} {'vs fp8 experts':>15s}")
    for name, r in results.items():
        speed = f"{base / r['ms']:.3f}x" if base else "-"
        print(f"{name:14s} {r['ms']:11.2f} {r['wire_bytes'] / 1e6:13.1f} {speed:>15s}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"device": device, "args": {k: str(v) for k, v in vars(a).items()},
                                      "rows": results}, indent=1))


def main(argv=None) -> None:
    a = _parse(argv)
    if a.device == "cuda":
        import torch

        if torch.cuda.device_count() < a.gpus:
            raise SystemExit(f"--gpus {a.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
        if torch.cuda.get_device_capability(0) < (9, 0):
            raise SystemExit("the e4m3 grouped GEMM needs an SM90+ GPU (H100, H200)")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(a, os.path.join(tmp, "store")), nprocs=a.gpus, join=True)


if __name__ == "__main__":
    main()
