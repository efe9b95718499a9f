"""Step time and memory of whole-layer recompute with and without activation offload (``parallel.cpu_offloading``).

    python benchmarks/offload_step.py --json $OUT/offload_step.json     # one H200, about 2 minutes
    python benchmarks/offload_step.py --device cpu --tiny                # smoke run on any machine, seconds

Model (default): Flash widths (``memory_calibration.FLASH_WIDTHS``: dim 4096, 64 heads x 512, 6 of 16 routed
experts + 1 shared, vocab 129,280, no MTP), L decoder layers alternating CSA (ratio 4) / HCA (ratio 128), one
packed sequence of T tokens, in the sparse phase on the Triton kernels (``memory_calibration.recipe_for``),
bf16 autocast over fp32 parameters, ``recompute_granularity: full`` (``model/parallel/recompute.py``).
``--tiny``: a 2-layer model of dim 32 (CSA, HCA + 1 MTP layer) on the reference path, float32, where every
layer input is offloaded (``min_bytes=0``; on the CPU into a separate CPU buffer, ``cpu_tensors=True``).

Rows, on one model (same weights, same batch): ``full``, then ``full+offload``
(``model/parallel/offload.py``'s ``apply_activation_offload`` applied to it). Each row: ``--warmup`` iterations,
then ``--iters`` timed ones; an iteration = forward + backward, gradients set to None before it (as the job's
step), no optimizer.

Columns (GiB = 2**30 bytes, MiB under ``--tiny``; ``params`` = memory allocated before the first forward):
  ms          median forward + backward time (CUDA events on the GPU, wall clock on the CPU)
  fwd GiB     ``torch.cuda.memory_allocated`` right after the forward minus params: what backward keeps
  peak GiB    ``torch.cuda.max_memory_allocated`` over a timed iteration minus params
  host GiB    peak host bytes held by the offloaded inputs (``OffloadStats.peak_host_bytes``; pinned on CUDA);
              the JSON's ``pinned`` is torch's pinned pool after the row (cached blocks, rounded up to powers of 2)
  moved GiB   bytes copied to host per forward (``OffloadStats.last_forward_bytes``)
  pref/late/wait  copies back per iteration: prefetched, started late (at their own unpack), prefetched but
              not finished when unpacked
  loss        the row's last loss (the copies are exact: equal across rows where the kernels are repeatable)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = float(1 << 30)

TINY = dict(vocab_size=512, dim=32, n_layers=2, n_mtp_layers=1, compress_ratios=(4, 128, 0), n_heads=4, head_dim=16,
            rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, window_size=8, index_n_heads=8,
            index_head_dim=16, index_topk=3, n_routed_experts=4, n_activated_experts=2, n_shared_experts=1,
            moe_inter_dim=32, n_hash_layers=0, hc_mult=2, original_seq_len=64, rope_factor=4.0)
"""``--tiny``'s model (tests/model/v4_helpers.py's widths)."""


def build(a):
    """(model under full recompute, (tokens, cu_seqlens, max_seqlen, labels), device, description)."""
    import torch

    from v4launch.model import ModelArgs, V4Model
    from v4launch.model.parallel.recompute import FULL_LAYER, apply_recompute

    device = torch.device(a.device)
    if a.tiny:
        args, chunk, kernels, what = ModelArgs(**TINY), 16, "reference", "tiny (dim 32, CSA + HCA + MTP)"
    else:
        from memory_calibration import FLASH_WIDTHS, recipe_for  # noqa: PLC0415  (pydantic: the GPU run only)
        from v4launch.training.model_adapter import model_args_from_recipe

        recipe = recipe_for(FULL_LAYER, a.layers, a.tokens, a.phase, a.kernels)
        args, chunk, kernels = model_args_from_recipe(recipe), recipe.attention.kl_chunk_size, a.kernels
        what = f"Flash widths {FLASH_WIDTHS['dim']} x {a.layers} layers (CSA/HCA)"
    torch.manual_seed(0)
    try:
        with device:  # drawn on the device: a CPU draw of the Flash-width parameters takes minutes
            model = V4Model(args, phase="dense", chunk_size=chunk, kernel_backend=kernels)
    except RuntimeError as exc:  # a seeded CPU draw (e.g. a hash router's table) refused there
        print(f"built on the CPU ({exc})")
        model = V4Model(args, phase="dense", chunk_size=chunk, kernel_backend=kernels).to(device)
    model.set_phase(a.phase)  # the indexers: seeded CPU draws (refused under a CUDA default device), copied over
    apply_recompute(model, [FULL_LAYER])
    T = a.tokens
    tokens = torch.randint(0, args.vocab_size, (T,), device=device)
    labels = torch.randint(0, args.vocab_size, (T,), device=device)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    return model, (tokens, cu, T, labels), device, f"{what}, T={T}, {a.phase}, {kernels}"


def measure(model, batch, device, warmup: int, iters: int) -> dict:
    """One row: median ms, memory after forward and peak (CUDA), offload counts of the last iteration, loss."""
    import torch

    from v4launch.model.parallel.offload import offload_stats, reset_offload_stats

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    for p in model.parameters():  # the previous row's gradients are not this row's memory
        p.grad = None
    sync()
    params = allocated()
    times, fwd, peaks, losses = [], [], [], []
    for it in range(warmup + iters):
        for p in model.parameters():
            p.grad = None
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        reset_offload_stats()
        t0 = time.perf_counter()
        with autocast:
            out = model(*batch)
            loss = out.lm_loss + sum(out.aux_losses.values())
        after_forward = allocated() - params  # the allocator's count: no sync needed
        loss.backward()
        if cuda:
            end.record()
        sync()
        ms = start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3
        losses.append(loss.item())
        if it >= warmup:
            times.append(ms)
            fwd.append(after_forward)
            peaks.append(torch.cuda.max_memory_allocated() - params if cuda else 0)
    s = offload_stats()
    pinned = None  # the pinned pool (cached blocks too, rounded up); keys as in torch >= 2.6
    if cuda and hasattr(torch.cuda, "host_memory_stats"):
        pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current")
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()
                                                      if p.grad is not None])).item()
    return {"ms": statistics.median(times), "ms_all": times, "params": params, "after_forward": max(fwd),
            "peak": max(peaks), "host_peak": s.peak_host_bytes, "pinned": pinned, "moved": s.last_forward_bytes,
            "offloaded_tensors": s.offloaded_tensors, "prefetched": s.prefetched, "late": s.late,
            "waited": s.waited, "loss": losses[-1], "losses": losses, "grad_norm": grad_norm}


def _same(base: list[float], off: list[float]) -> str:
    """Whether the offload row's losses are the plain row's; where they differ, by how much beside how much the
    plain row's own iterations differ (kernels with atomic adds are not bitwise repeatable)."""
    if set(off) == set(base) and len(set(base)) == 1:
        return "equal"
    spread = max(base) - min(base)
    return f"differs by {max(abs(x - base[-1]) for x in off):.2e} (the full row's own iterations by {spread:.2e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny model (smoke run; any device)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers, alternating CSA / HCA (default 4)")
    ap.add_argument("--tokens", type=int, default=None, help="T (default 65536; 1024 with --tiny)")
    ap.add_argument("--phase", default="sparse", choices=["dense", "warmup", "sparse"])
    ap.add_argument("--kernels", default="triton", help="attention.kernel_backend (default triton; --tiny: reference)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first (Triton compiles in the first)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.tokens = a.tokens or (1024 if a.tiny else 65536)

    import torch

    from v4launch.model.parallel.offload import MIN_BYTES, apply_activation_offload

    model, batch, device, what = build(a)
    print(what, flush=True)
    small = a.tiny or device.type == "cpu"
    offload = dict(min_bytes=0, cpu_tensors=device.type == "cpu") if small else dict(min_bytes=MIN_BYTES)
    rows = {}
    size, u = (float(1 << 20), "MiB") if a.tiny else (GIB, "GiB")
    print(f"{'config':13} {'ms':>9} {'fwd ' + u:>8} {'peak ' + u:>9} {'host ' + u:>9} {'moved ' + u:>10} "
          f"{'pref/late/wait':>15} {'loss':>10}")
    for name in ("full", "full+offload"):
        if name == "full+offload":
            apply_activation_offload(model, **offload)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = rows[name] = measure(model, batch, device, a.warmup, a.iters)
        print(f"{name:13} {r['ms']:9.1f} {r['after_forward'] / size:8.2f} {r['peak'] / size:9.2f} "
              f"{r['host_peak'] / size:9.2f} {r['moved'] / size:10.2f} "
              f"{r['prefetched']:>5}/{r['late']}/{r['waited']:<5} {r['loss']:10.5f}", flush=True)
    base, off = rows["full"], rows["full+offload"]
    print(f"offload: {(base['after_forward'] - off['after_forward']) / size:.2f} {u} less after forward, "
          f"{(base['peak'] - off['peak']) / size:.2f} {u} lower peak, {off['ms'] / base['ms'] - 1:+.1%} time, "
          f"loss {_same(base['losses'], off['losses'])}")
    if a.json:
        meta = {"what": what, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}
        a.json.write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
