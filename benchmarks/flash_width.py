"""Flash-width throughput on one GPU: the decoder layers a recipe trains, per phase, at its real widths.

    python benchmarks/flash_width.py --json $OUT/flash_width.json                 # one H200, ~5 minutes
    python benchmarks/flash_width.py --rows sparse:4 dense:4 warmup:4 --profile sparse:4
    python benchmarks/flash_width.py --device cpu --tiny                           # smoke run, seconds

What one row runs (``--recipe``, default recipes/flash_4n.yaml, stage ``--stage``, default 0):

* the recipe's widths (dim, heads x head_dim, q/o LoRA ranks, indexer heads x dim and top-k, mHC, vocab) with
  L decoder layers alternating CSA (ratio 4) / HCA (ratio 128) as the recipe's pattern does, no MTP layer;
* the routed experts ONE rank holds under the recipe's EP: ``n_routed_experts / ep`` experts with the
  recipe's top-k. With balanced routing a rank's experts then receive exactly the rows they receive in the run
  (EP ranks x tokens x top-k / n_routed per expert = tokens x top-k / local experts); the all-to-all that
  brings them is not run (the time plan prices it apart); hash-routed layers are run as learned-routed ones;
* ``--tokens`` tokens (default the stage's seq_len: one packed sequence, as a CP=1 rank would hold it; under
  CP a rank holds seq_len / cp rows of the same context, so the per-token work is the same, less the
  CP exchange);
* the recipe's recompute granularity, storage (``precision.params_dtype``: bf16 GEMM weights, no FSDP on
  one GPU) and bf16 autocast; the kernel backend per row (``triton`` unless the row names ``reference``);
* eager, as the Flash recipes run (``compile.enable`` false; the mHC mixing regions are compiled on a GPU either
  way), or with ``--compile inductor`` each decoder block compiled as ``compile.enable`` compiles it
  (``model.compile.compile_blocks``: under whole-layer recompute, the recomputed forward), to price turning it
  on; ``--compile aot_eager`` traces without generating code (a CPU check of the tracing);
* on a GPU the elementwise chains of an eager step (RMSNorm, RoPE, the mHC mixing) as compiled regions
  (model/regions.py), as the job runs them; ``--no-regions`` runs them eagerly (the A/B: both runs in one device
  session).

One iteration = forward + backward of the LM loss plus the aux losses (indexer KL, balance), gradients set
to None before it; no optimizer step (benchmarks/optimizer_step.py measures it). ``--warmup`` untimed
iterations first (Triton autotunes in the first), then ``--iters`` timed ones (CUDA events, median).

Columns:
  ms           median forward + backward, the whole model (embedding, L layers, head and loss)
  tok/s        tokens / ms
  TFLOP/s      the time plan's FLOPs of the step (validators/time_plan.step_flops_per_token x tokens:
               forward x3, + a forward of every layer under whole-layer recompute) / ms
  MFU          TFLOP/s over the sustained bf16 matmul peak measured in this process (8192^3 GEMMs back to
               back for ~1 s; benchmarks/train_step.matmul_peaks)
  layer ms     (ms at L - ms at L') / (L - L') for two rows of one phase: a layer pair without the embedding,
               head and loss; ``layer MFU`` the same difference of FLOPs over it
  peak GiB     torch.cuda.max_memory_allocated over a timed iteration

``--profile phase:L`` adds one profiled iteration of that row: GPU kernel time per region, by kernel name
(:data:`REGIONS`; the JSON keeps the top kernels so a reader can re-class them), and the share of the
iteration the GPU is busy; ``--sites`` adds the time per model function that launched it (:func:`source_sites`).
Raises: SystemExit on a bad ``--rows`` entry.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = float(1 << 30)

REGIONS = [
    ("attention fwd", r"_sparse_fwd|_fwd_tile"),
    ("attention bwd", r"_sparse_bwd|_dkv|_dq_|red_add_rows|_bwd_tile|_tile_rows"),
    ("KL teacher + student", r"_teacher|_student"),
    ("indexer scores + top-k", r"_index_scores|topk|radix|sort|bitonic"),
    ("MoE grouped GEMMs", r"[Gg]roup"),
    ("other GEMMs", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|wgmma"),
    ("cross entropy", r"_lse_target|_softmax_grad|cross_entropy|log_softmax"),
    ("mHC Sinkhorn", r"_sinkhorn"),
    ("norms", r"norm"),
]
"""(region, regex on the CUDA kernel name), first match wins; the rest is "elementwise and other" (casts,
SwiGLU, RoPE, copies, scatter/gather of routed rows, inductor's fused kernels)."""

TINY_MODEL = dict(vocab_size=512, dim=64, n_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2,
                  o_lora_rank=16, window_size=8, indexer={"n_heads": 4, "head_dim": 16, "topk": 8, "hadamard": False},
                  moe={"n_routed_experts": 8, "n_activated_experts": 2, "n_shared_experts": 1, "moe_inter_dim": 32,
                       "n_hash_layers": 0}, mhc={"hc_mult": 2, "sinkhorn_iters": 3, "eps": 1e-6},
                  max_position_embeddings=4096)
"""``--tiny``: the smoke run's widths (any device, seconds)."""


def region_of(kernel: str) -> str:
    """The :data:`REGIONS` name of a CUDA kernel name, else "elementwise and other"."""
    for name, pattern in REGIONS:
        if re.search(pattern, kernel):
            return name
    return "elementwise and other"


def bench_recipe(path: str, stage: int, phase: str, layers: int, tokens: int | None, backend: str, tiny: bool,
                 precision: str = "bf16"):
    """The one-GPU recipe of a row (schema-validated, not rule-checked) and the source recipe's EP; ``precision``
    "fp8" sets ``precision.fp8_recipe: blockwise`` (bf16: the recipe's own).

    Returns: (recipe, {"ep", "local_experts", "top_k", "tokens"}).
    Raises: RecipeError (v4launch.errors) for an unreadable recipe.
    """
    from v4launch.recipe_loading import load_recipe
    from v4launch.validators.schema.recipe import Recipe

    loaded = load_recipe(path)
    src, data = loaded.recipe, copy.deepcopy(loaded.resolved)
    m = data["model"]
    if tiny:
        m.update({k: ({**m[k], **v} if isinstance(v, dict) else v) for k, v in TINY_MODEL.items()})
    ep = src.parallel.ep
    local = max(1, m["moe"]["n_routed_experts"] // ep)
    k = min(m["moe"]["n_activated_experts"], local)
    m.update(n_layers=layers, compress_ratios=[4, 128] * (layers // 2) + [4] * (layers % 2))
    m["mtp"] = {**m["mtp"], "depth": 0}
    m["moe"] = {**m["moe"], "n_routed_experts": local, "n_activated_experts": k, "n_hash_layers": 0}
    m["init_from_released"] = False
    stage_seq = src.curriculum.stages[stage].seq_len  # IndexError: no such stage (main() says so)
    seq = tokens or (256 if tiny else stage_seq)
    m["max_position_embeddings"] = max(m["max_position_embeddings"], seq)
    data["parallel"] = {**data["parallel"], "pp": 1, "vpp": 1, "ep": 1, "cp": 1, "cpu_offloading": False,
                        "micro_batch_size": 1, "global_batch_size": 1,
                        "distributed_optimizer": False, "pp_layout": None}
    data["attention"] = {**data["attention"], "kernel_backend": backend}
    if precision == "fp8":
        data["precision"] = {**data["precision"], "fp8_recipe": "blockwise"}
    data["cluster"] = {**data["cluster"], "nodes": 1, "gpus_per_node": 1}
    if tiny:
        data["cluster"]["gpu"] = "cpu"
        data["precision"] = {**data["precision"], "dtype": "fp32"}
    data["curriculum"] = {"stages": [{"name": f"{phase}_{seq}", "seq_len": seq, "phase": phase, "steps": 1}]}
    data.pop("slurm", None)
    return Recipe.model_validate(data), {"ep": ep, "local_experts": local, "top_k": k, "tokens": seq}


def build(recipe, device, compile_backend: str | None = None):
    """(model with the recipe's recompute and storage, batch (tokens, cu_seqlens, max_seqlen, labels)); with
    ``compile_backend`` its blocks compiled (``compile_blocks``) after the recompute wrappers are applied."""
    import torch

    from v4launch.model import V4Model
    from v4launch.model.parallel.recompute import apply_recompute, modules_from_recipe
    from v4launch.model.parallel.storage import apply_param_storage
    from v4launch.training.model_adapter import model_args_from_recipe

    st = recipe.curriculum.stages[0]
    args = model_args_from_recipe(recipe)
    torch.manual_seed(0)
    kw = dict(chunk_size=recipe.attention.kl_chunk_size, kernel_backend=recipe.attention.kernel_backend)
    try:
        with device:  # drawn on the device: a CPU draw of Flash-width parameters takes minutes
            model = V4Model(args, phase="dense", **kw)
    except RuntimeError:  # a seeded CPU draw refused under a CUDA default device
        model = V4Model(args, phase="dense", **kw).to(device)
    if st.phase != "dense":
        model.set_phase("warmup")
    if st.phase == "sparse":
        model.set_phase("sparse")
    model.to(device)
    if recipe.precision.fp8_recipe != "none":  # before recompute and storage, as parallelize_model orders them
        from v4launch.model.parallel.precision import apply_fp8

        apply_fp8(model, recipe.precision, emulate=device.type != "cuda")
    apply_recompute(model, modules_from_recipe(recipe.parallel.recompute_granularity,
                                               recipe.parallel.recompute_modules))
    if device.type == "cuda":
        apply_param_storage(model, recipe.precision.params_dtype, fsdp=False)
    if compile_backend is not None:
        from v4launch.model.compile import compile_blocks

        compile_blocks(model, backend=compile_backend)
    T = st.seq_len
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (T,), generator=g).to(device)
    labels = torch.randint(0, args.vocab_size, (T,), generator=g).to(device)
    cu = torch.tensor([0, T], dtype=torch.int32)
    return model, (tokens, cu, T, labels)


def iteration(model, batch, device):
    """Forward + backward of lm loss + aux losses; returns the loss as a tensor."""
    import torch

    for p in model.parameters():
        p.grad = None
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(*batch)
        loss = out.lm_loss + sum(out.aux_losses.values())
    loss.backward()
    return loss.detach()


def measure(model, batch, device, warmup: int, iters: int) -> dict:
    """Median ms (CUDA events; wall clock on the CPU), every timed ms, peak bytes, last loss."""
    import torch

    cuda = device.type == "cuda"
    times, losses = [], []
    for it in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        loss = iteration(model, batch, device)
        if cuda:
            end.record()
            torch.cuda.synchronize()
        ms = start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3
        losses.append(float(loss))
        if it >= warmup:
            times.append(ms)
    return {"ms": statistics.median(times), "ms_all": times, "loss": losses[-1],
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0}


def profile(model, batch, device, top: int, sites: bool = False) -> dict:
    """One profiled iteration: GPU ms per region (:func:`region_of`), busy share, the top kernels; with ``sites``
    also the model functions the time was launched from (:func:`source_sites`)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch_profile(activities=acts, with_stack=sites) as prof:
        iteration(model, batch, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    dev = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    kernels = [e for e in prof.key_averages() if dev(e) > 0 and e.self_cpu_time_total == 0]
    regions: dict[str, float] = {}
    for e in kernels:
        regions[region_of(e.key)] = regions.get(region_of(e.key), 0.0) + dev(e) / 1e3
    gpu_ms = sum(regions.values())
    kernels.sort(key=dev, reverse=True)
    out = {"wall_ms": wall_ms, "gpu_ms": gpu_ms, "regions_ms": dict(sorted(regions.items(), key=lambda kv: -kv[1])),
           "top_kernels": [{"name": e.key[:120], "ms": dev(e) / 1e3, "calls": e.count, "region": region_of(e.key)}
                           for e in kernels[:top]]}
    if sites:
        out["sites"] = source_sites(prof.events(), cuda=device.type == "cuda")[:top]
    return out


SITE_FRAME = re.compile(r"^(?P<path>.+?)\((?P<line>\d+)\): (?P<func>.+)$")
"""One frame of a profiled op's Python stack, as torch.profiler writes it: ``/path/file.py(123): function``."""


def source_sites(events, cuda: bool) -> list[dict]:
    """Where one iteration's time was launched from: each profiled ``aten::`` op's own time (the GPU time of the
    kernels it launched on CUDA, its CPU time elsewhere) summed by the innermost function of the model package
    (``model/…``, named by the line of its ``def``) among its Python callers; ops with none are summed under
    "other": the backward of built-in autograd ops runs on autograd's own thread without a Python stack (custom
    ``autograd.Function`` backwards and recomputed forwards do have one). Most time first:
    ``{"site": "model/common.py:71 forward", "ms", "ops": {op name: calls}}``. Needs a profile taken
    ``with_stack=True`` (its Python function events are the ops' parents)."""
    import v4launch.model

    model_dir = str(Path(v4launch.model.__file__).resolve().parent) + "/"  # the installed package's, not the checkout's
    totals: dict[str, dict] = {}
    for e in events:
        us = getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total
        if us <= 0 or not e.name.startswith("aten::"):
            continue
        where, parent = "other", e.cpu_parent
        while parent is not None:
            m = SITE_FRAME.match(parent.name)
            if m and m["path"].startswith(model_dir):
                where = f"model/{m['path'][len(model_dir):]}:{m['line']} {m['func']}"
                break
            parent = parent.cpu_parent
        site = totals.setdefault(where, {"site": where, "ms": 0.0, "ops": {}})
        site["ms"] += us / 1e3
        site["ops"][e.name] = site["ops"].get(e.name, 0) + 1
    return sorted(totals.values(), key=lambda t: -t["ms"])


BACKENDS, PRECISIONS = ("triton", "reference"), ("bf16", "fp8")


def parse_rows(entries: list[str], option: str = "--rows") -> list[tuple[str, int, str, str]]:
    """``phase:L[:backend][:precision]`` entries -> (phase, L, backend, precision); backend triton (default) or
    reference, precision bf16 (default: the recipe's) or fp8 (the recipe with ``precision.fp8_recipe:
    blockwise``: torchao rowwise FP8 for the GEMMs the V4 policy allows, the routed experts' grouped GEMM
    included). Raises SystemExit naming ``option`` and the bad entry."""
    rows = []
    for e in entries:
        parts = e.split(":")
        extra = parts[2:]
        backend = next((x for x in extra if x in BACKENDS), "triton")
        precision = next((x for x in extra if x in PRECISIONS), "bf16")
        if len(parts) < 2 or parts[0] not in ("dense", "warmup", "sparse") or not parts[1].isdigit() \
                or int(parts[1]) < 1 or any(x not in BACKENDS + PRECISIONS for x in extra) \
                or sum(x in BACKENDS for x in extra) > 1 or sum(x in PRECISIONS for x in extra) > 1:
            raise SystemExit(f"{option} entry {e!r}: must be phase:L[:backend][:precision] with phase "
                             "dense|warmup|sparse, L >= 1 decoder layers, backend triton|reference, precision bf16|fp8 "
                             "(e.g. sparse:4, warmup:2:reference or sparse:4:fp8)")
        rows.append((parts[0], int(parts[1]), backend, precision))
    return rows


def _shown(backend: str, precision: str) -> str:
    """The table's backend column: the kernels, and the precision when it is not bf16 (``triton/fp8``)."""
    return backend if precision == "bf16" else f"{backend}/{precision}"


def layer_rates(rows: list[dict], peak: float | None) -> list[dict]:
    """Per phase, backend and precision, the layer pair from the rows of the fewest and most layers (the embedding, head
    and loss cancel): ms per layer, TFLOP/s and MFU of the layers alone."""
    out = []
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        if "ms" in r:
            groups.setdefault((r["phase"], r["backend"], r.get("precision", "bf16")), []).append(r)
    for (phase, backend, precision), rs in groups.items():
        rs.sort(key=lambda r: r["layers"])
        lo, hi = rs[0], rs[-1]
        if hi["layers"] == lo["layers"] or hi["ms"] <= lo["ms"]:
            continue
        n = hi["layers"] - lo["layers"]
        ms = (hi["ms"] - lo["ms"]) / n
        flops = (hi["flops"] - lo["flops"]) / n
        tf = flops / ms / 1e9
        out.append({"phase": phase, "backend": backend, "precision": precision, "from_layers": [lo["layers"], hi["layers"]],
                    "layer_ms": ms, "layer_flops": flops, "layer_tflops": tf,
                    "layer_mfu": tf / peak if peak else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "flash_4n.yaml"))
    ap.add_argument("--stage", type=int, default=0, help="curriculum stage whose seq_len is the default --tokens")
    ap.add_argument("--rows", nargs="*", default=["sparse:2", "sparse:4", "dense:2", "dense:4", "warmup:2", "warmup:4"],
                    help="phase:L[:backend] (default: 2 and 4 layers of each phase)")
    ap.add_argument("--profile", nargs="*", default=["sparse:4", "warmup:4"], help="rows to profile once")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small widths (smoke run on any device)")
    ap.add_argument("--no-regions", action="store_true",
                    help="run RMSNorm, RoPE and the mHC mixing eagerly (model/regions.py off): the A/B of the regions")
    ap.add_argument("--compile", choices=("none", "inductor", "aot_eager"), default="none",
                    help="compile each decoder block as compile.enable does (default: eager, as the Flash recipes run)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--top", type=int, default=25, help="kernels (and source sites) kept per profile")
    ap.add_argument("--sites", action="store_true",
                    help="profiles also sum the time by the model function that launched it (a Python stack per op)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip rows that would start after this")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rows_wanted = parse_rows(a.rows)
    profiled = set(parse_rows(a.profile, "--profile"))
    for name, value, least in (("--iters", a.iters, 1), ("--warmup", a.warmup, 0), ("--tokens", a.tokens, 1),
                               ("--top", a.top, 1), ("--stage", a.stage, 0)):
        if value is not None and value < least:
            raise SystemExit(f"{name} {value}: must be at least {least}")
    from v4launch.errors import RecipeError

    try:
        bench_recipe(a.recipe, a.stage, "sparse", 2, a.tokens, "triton", a.tiny)  # bad input: one line, before torch
    except RecipeError as exc:
        raise SystemExit(f"--recipe {a.recipe}: {exc.message}") from None
    except IndexError:
        raise SystemExit(f"--stage {a.stage}: the recipe has no such curriculum stage (0-based)") from None

    import torch

    from v4launch.validators.time_plan import step_flops_per_token

    try:
        device = torch.device(a.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available in this torch")
    except RuntimeError as exc:
        raise SystemExit(f"--device {a.device}: {exc} (use --device cpu with --tiny for a smoke run)") from None
    t_start = time.perf_counter()
    peak = None
    if device.type == "cuda":
        from train_step import matmul_peaks  # noqa: PLC0415  (imports torch and the model: the GPU run only)

        sustained, burst = matmul_peaks()
        peak = sustained
        print(f"{torch.cuda.get_device_name()}: bf16 matmul peak {sustained:.0f} TFLOP/s sustained, "
              f"{burst:.0f} burst (8192^3)", flush=True)
    shown = Path(a.recipe).resolve()
    shown = str(shown.relative_to(ROOT)) if shown.is_relative_to(ROOT) else a.recipe  # no machine paths in results
    if a.no_regions:
        from v4launch.model import mhc, regions

        regions.set_fused_regions(False)
        mhc.set_fused_mixing(False)
    meta = {"recipe": shown, "stage": a.stage, "compile": a.compile, "regions": not a.no_regions,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "peak_tflops_sustained": peak, "rows": [], "profiles": []}
    print(f"{'phase':7} {'L':>2} {'backend':9} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
    for phase, L, backend, precision in rows_wanted:
        row: dict = {"phase": phase, "layers": L, "backend": backend, "precision": precision}
        backend_shown = _shown(backend, precision)
        if time.perf_counter() - t_start > a.budget_s:
            row["skipped"] = f"past --budget-s {a.budget_s:.0f}"
            meta["rows"].append(row)
            print(f"{phase:7} {L:>2} {backend_shown:9} skipped ({row['skipped']})", flush=True)
            continue
        recipe, shape = bench_recipe(a.recipe, a.stage, phase, L, a.tokens, backend, a.tiny, precision)
        row.update(shape)
        try:
            model, batch = build(recipe, device, None if a.compile == "none" else a.compile)
            row["flops"] = step_flops_per_token(recipe, recipe.curriculum.stages[0]) * shape["tokens"]
            from v4launch.model.kernels.dispatch import select_backend

            used = select_backend(backend, device)
            if used.name != backend:  # e.g. triton on a CPU: the reference kernels run, and the row says so
                row.update(backend_used=used.name, backend_note=used.reason)
                backend_shown = _shown(used.name, precision)  # what ran
                print(f"  ({phase}:{L}: {used.reason})",
                      flush=True)
            row.update(measure(model, batch, device, a.warmup, a.iters))
            if (phase, L, backend, precision) in profiled:
                meta["profiles"].append({"phase": phase, "layers": L, "backend": backend, "precision": precision,
                                         **profile(model, batch, device, a.top, a.sites)})
        except Exception as exc:  # a row out of memory is reported; the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            model = batch = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        meta["rows"].append(row)
        if "ms" in row:
            tf = row["flops"] / row["ms"] / 1e9
            row.update(tokens_per_s=shape["tokens"] / row["ms"] * 1e3, tflops=tf, mfu=tf / peak if peak else None)
            mfu = f"{100 * row['mfu']:5.1f}%" if peak else "    -"
            print(f"{phase:7} {L:>2} {backend_shown:9} {row['ms']:9.1f} {row['tokens_per_s']:9.0f} {tf:8.1f} {mfu:>6} "
                  f"{row['peak_bytes'] / GIB:9.2f}", flush=True)
        else:
            print(f"{phase:7} {L:>2} {backend_shown:9} {row['error'][:100]}", flush=True)
        if a.json:  # after every row: a later one may run out of memory or time
            a.json.write_text(json.dumps(meta, indent=1))
    meta["layers"] = layer_rates(meta["rows"], peak)
    for r in meta["layers"]:
        mfu = f", {100 * r['layer_mfu']:.1f}% MFU" if r["layer_mfu"] else ""
        print(f"layers alone ({r['phase']}, {r['backend']}, {r['precision']}, "
              f"L {r['from_layers'][0]} -> {r['from_layers'][1]}): "
              f"{r['layer_ms']:.1f} ms per layer, {r['layer_tflops']:.1f} TFLOP/s{mfu}")
    for p in meta["profiles"]:
        busy = f"GPU busy {p['gpu_ms']:.1f} of" if device.type == "cuda" else "no GPU kernels (CPU run):"
        print(f"\nprofile {p['phase']}:{p['layers']} ({p['backend']}, {p['precision']}): {busy} "
              f"{p['wall_ms']:.1f} ms wall")
        for name, ms in p["regions_ms"].items():
            print(f"  {name:26} {ms:9.1f} ms {100 * ms / p['gpu_ms']:5.1f}%")
        for site in p.get("sites", [])[:15]:
            ops = ", ".join(f"{k} x{n}" for k, n in sorted(site["ops"].items(), key=lambda kv: -kv[1])[:3])
            print(f"  {site['ms']:9.1f} ms  {site['site']}  ({ops})")
    if a.json:
        a.json.write_text(json.dumps(meta, indent=1))
    failed = [r for r in meta["rows"] if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(meta['rows'])} rows failed (the table and --json say which)")


if __name__ == "__main__":
    main()
