"""Whole training step of a ~1.1B-parameter V4-shaped model on one GPU: ms/step, tokens/s and MFU per phase.

    python benchmarks/train_step.py                                   # dense, warmup, sparse; kernels path
    python benchmarks/train_step.py --phases sparse --paths reference,kernels
    python benchmarks/train_step.py --compile                         # + regional torch.compile of each block
    python benchmarks/train_step.py --no-wide-gemm --no-fused-ce --no-fused-mhc --cu-on-device   # levers off
    python benchmarks/train_step.py --phases sparse --profile $OUT/prof   # trace + top kernels + CPU vs GPU
    python benchmarks/train_step.py --phases sparse --sync-trace         # where the step waits on the GPU
    python benchmarks/train_step.py --compile --cuda-graph               # the whole step as one CUDA graph
    python benchmarks/train_step.py --compile --cuda-graph --fp32-params # float32 parameters under bf16 autocast
    python benchmarks/train_step.py --compile --cuda-graph --no-query-blocks # range-only layers' backward in the single pass
    python benchmarks/train_step.py --compile --cuda-graph --span-per-column 0 # sparse CSA's columns per query

Model: ModelArgs with V4 structure scaled down (dim 1024, 8 layers SWA/CSA/HCA + 1 MTP,
16 heads x 512, rope 64, window 128, indexer 16 x 128 top-512, 24 routed experts top-4 +
1 shared, mHC 4, vocab 129280), bf16 parameters (hc_*, ape, sinks FP32-pinned), fused AdamW; with
``--fp32-params`` float32 parameters under bf16 autocast, as ``v4launch run`` trains with precision.dtype bf16
(its fused AdamW then steps float32 parameters, and each compiled block casts its weights every step).
One step = forward + backward + optimizer step + router-bias update, on ``--tokens`` tokens
packed as segments of ``--seg``. Paths: ``reference`` (the attention in plain PyTorch) and
``kernels`` (the model's own dispatch with ``kernel_backend="triton"``: the attention, indexer and KL
kernels and the head cross entropy's row passes, as a product run selects them).

Levers (issue 17), each on by default and switchable for A/B measurements:
  --no-wide-gemm   float32 products of bf16 activations as float32 GEMMs (matmul.set_wide_gemm)
  --no-fused-ce    LM/MTP heads as a whole [T, vocab] float32 logits tensor (loss.set_fused_head)
  --no-fused-mhc   eager mHC mixing on CUDA (mhc.set_fused_mixing)
  --cu-on-device   cu_seqlens on the GPU (the model then reads it back: one more sync per forward)
  --no-query-blocks  the range-only layers' attention backward in the single-pass kernel instead of query blocks
                   (triton_attention.QUERY_BLOCK_BACKWARD, on by default: SWA and HCA layers, CSA's window)
  --span-per-column N  sparse CSA's top-k columns in query blocks as a masked span where the span is at most N
                   rows per column (triton_attention.SPAN_PER_COLUMN, 2 by default; 0 = never: the single pass)
  --compile        compile.compile_blocks (off by default)

Columns: ms/step (CUDA events, median of --steps), host ms (wall time until the host returns from
the step without a final synchronisation; below ms/step = the host runs ahead), tokens/s,
TFLOP/s, MFU against the bf16 matmul peak measured in this process (sustained: 8192^3 GEMMs
back to back for ~1 s; burst: median of 10), peak memory.

FLOPs per step (MFU numerator):
  6 * N_active * T                          (matmul params touched per token: everything
                                             except the embedding table; routed experts
                                             counted at top-k / E; head and MTP included)
  + 12 * H * D * sum_t n_cand(t) per layer  (attention core fwd 4HD + bwd 8HD per candidate)
  + 2 * H_I * d_I * sum_t n_visible(t) per CSA layer (indexer scoring, forward only)

bf16 parity (``--parity-tokens``, 0 = off): one float32 model, reference path = the truth; the
same weights in bf16 through each path. Error = relative error of the loss and relative L2
error of all gradients against the truth; a kernel path passes when neither error exceeds
1.5x the reference path's bf16 error (both paths round; a fixed limit would judge bf16 itself).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import DEV, cuda_time, load_model_package  # noqa: E402

M = load_model_package()
from v4launch.model import ModelArgs, V4Model  # noqa: E402
from v4launch.model import loss as loss_mod  # noqa: E402
from v4launch.model import matmul, mhc  # noqa: E402
from v4launch.model.compile import compile_blocks  # noqa: E402
from v4launch.training.step_profile import host_and_device_ms, host_waits  # noqa: E402
from v4launch.validators.derived import graph_free_reason  # noqa: E402

RATIOS = (0, 4, 128, 4, 128, 4, 128, 4, 0)
LAUNCH_CALLS = {"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"}
"""Host-side launch calls as torch.profiler names them (PyTorch's kernels, Triton's and inductor's)."""
KERNEL_BACKEND = {"reference": "reference", "kernels": "triton"}
"""Benchmark path -> the model's ``kernel_backend`` (``V4Model.set_kernel_backend``)."""
PARITY_LIMIT = 1.5


def make_args() -> ModelArgs:
    return ModelArgs(vocab_size=129280, dim=1024, n_layers=8, n_mtp_layers=1, compress_ratios=RATIOS,
                     n_heads=16, head_dim=512, rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512,
                     window_size=128, index_n_heads=16, index_head_dim=128, index_topk=512, n_routed_experts=24,
                     n_activated_experts=4, moe_inter_dim=1024, n_hash_layers=1, hc_mult=4)


def flops_per_step(model: V4Model, args: ModelArgs, lengths: list[int]) -> tuple[float, dict]:
    total = sum(p.numel() for p in model.parameters())
    embed = model.embed.weight.numel()
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - embed - routed * (1 - args.n_activated_experts / args.n_routed_experts)
    T = sum(lengths)
    H, D = args.n_heads, args.head_dim
    attn = idx = 0.0
    for r in args.compress_ratios:
        for L in lengths:
            p = torch.arange(L, dtype=torch.float64)
            cand = torch.clamp(p + 1, max=args.window_size)
            if r == 4:
                nvis = torch.floor((p + 1) / 4)
                cand = cand + (nvis.clamp(max=args.index_topk) if model.phase != "dense" else nvis)
                if model.phase != "dense":
                    idx += 2 * args.index_n_heads * args.index_head_dim * float(nvis.sum())
            elif r == 128:
                cand = cand + torch.floor((p + 1) / 128)
            attn += 12 * H * D * float(cand.sum())
    f = 6 * active * T + attn + idx
    return f, dict(params=total, active=active, matmul_flops=6 * active * T, attn_flops=attn, indexer_flops=idx)


# ------------------------------------------------------------------------------------ set-up
def matmul_peaks(seconds: float = 1.0) -> tuple[float, float]:
    """(sustained, burst) bf16 TFLOP/s of 8192^3 GEMMs: back to back for ~``seconds``, and median of 10."""
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=DEV, dtype=torch.bfloat16)  # one output: ~600 kept products fill an 80 GB card

    def gemms(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b, out=c)

    gemms(3)
    burst_ms = cuda_time(lambda: gemms(1), 10)
    reps = max(10, int(seconds * 1e3 / burst_ms))
    sustained_ms = cuda_time(lambda: gemms(reps), 1) / reps
    return 2 * n ** 3 / sustained_ms / 1e9, 2 * n ** 3 / burst_ms / 1e9


def make_batch(args: ModelArgs, T: int, seg: int, cu_on_device: bool, seed: int = 0):
    """(tokens [T] on the GPU, cu_seqlens [N+1] int32 (CPU unless cu_on_device), max_seqlen, labels, lengths)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [seg] * (T // seg) + ([T % seg] if T % seg else [])
    tokens = torch.randint(0, args.vocab_size, (T,), generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    labels = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
    labels[cu[1:].long() - 1] = -100
    return tokens.to(DEV), (cu.to(DEV) if cu_on_device else cu), max(lengths), labels.to(DEV), lengths


def build_model(args: ModelArgs, phase: str, dtype: torch.dtype) -> V4Model:
    torch.manual_seed(0)
    model = V4Model(args, "dense").to(DEV)
    for later in ("warmup", "sparse")[: ("dense", "warmup", "sparse").index(phase)]:
        model.set_phase(later)
    return model.to(dtype)


def use_path(model: V4Model, path: str) -> V4Model:
    """Run ``model`` on the reference module (``reference``) or the Triton kernels (``kernels``)."""
    model.set_kernel_backend(KERNEL_BACKEND[path])
    return model


def total_loss(out):
    return out.lm_loss + sum((1.0 if k.startswith("indexer") else 0.01 if k.startswith("balance") else 0.3) * v
                             for k, v in out.aux_losses.items())


def graph_free(path: str) -> str | None:
    """Why ``--cuda-graph`` runs this path (kernels or reference) without a graph (compiled only, with
    ``--compile``), in the product's words and by its rule (``validators/derived.graph_free_reason``: the
    reference attention reads per-chunk entry ranges on the host; every phase on the kernels is captured);
    None: the step is captured."""
    return graph_free_reason("triton" if path == "kernels" else "reference")


def make_step(model: V4Model, batch, cuda_graph: bool = False, graph_warmup: int = 3, autocast: bool = False):
    """One training step (forward, backward, fused AdamW, router-bias update) as a callable.

    ``autocast``: the forward under bf16 autocast (the model's parameters float32: ``--fp32-params``, the product's
    precision), instead of a model whose parameters are bf16 themselves (the default).

    ``cuda_graph``: the whole step captured once in a CUDA graph and replayed (no host work per step). The
    batch's tables (ids checked, the pack, RoPE and compress plans) are built once outside the graph with
    ``V4Model.batch_context`` and the step runs ``V4Model.forward_in`` on them: check_ids' host read cannot be
    captured. The tables are captured as they are (the benchmark's batch never changes); the product gives its
    batches static shapes and copies each one's tables in (``training/graph_step.py``). The warm-up phase takes
    the product's static tables (``static_seqlen``): its dense KL then reads its query chunks from host ints
    (``layer.static_chunks``), where the exact tables read them on the device, which a capture forbids.
    ``graph_warmup`` eager steps on a side stream come first (compiling, Triton's first launches).
    """
    tokens, cu, max_seqlen, labels, _ = batch
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True,
                            capturable=cuda_graph)

    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def train_step():
        with amp():
            loss = total_loss(model(tokens, cu, max_seqlen, labels))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(1e-3)
    if not cuda_graph:
        return train_step
    ctx = model.batch_context(tokens, cu, max_seqlen, labels,
                              static_seqlen=max_seqlen if model.phase == "warmup" else None)

    def captured_step():
        with amp():
            loss = total_loss(model.forward_in(ctx, tokens, labels))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # the captured backward then writes the gradients, never adds to them
        model.update_router_bias(1e-3)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(graph_warmup):
            captured_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_step()
    return graph.replay


def host_ms(step, reps: int) -> float:
    """Median wall time until the host returns from ``step`` (no synchronisation at the end)."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        ts.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return sorted(ts)[len(ts) // 2]


# ----------------------------------------------------------------------------------- measuring
def measure(phase: str, path: str, a, peaks: tuple[float, float]) -> dict:
    """One (phase, path) row: a fresh bf16 model (float32 under bf16 autocast with ``--fp32-params``), warm-up
    steps, then the timed steps."""
    args = make_args()
    batch = make_batch(args, a.tokens, a.seg, a.cu_on_device)
    torch._dynamo.reset()
    model = use_path(build_model(args, phase, torch.float32 if a.fp32_params else torch.bfloat16), path)
    if a.compile:
        compile_blocks(model)
    flop, parts = flops_per_step(model, args, batch[4])
    no_graph = graph_free(path) if a.cuda_graph else None  # why --cuda-graph does not capture this row
    graph = a.cuda_graph and no_graph is None
    step = None if graph else make_step(model, batch, autocast=a.fp32_params)
    try:
        if step is None:  # capturing runs the graph warm-up steps itself
            try:
                step = make_step(model, batch, cuda_graph=True, autocast=a.fp32_params)
            except RuntimeError as e:  # something in the step cannot be captured: say what, keep the other rows
                return dict(phase=phase, path=path, error=f"CUDA graph capture failed: {str(e)[:300]}")
        t0 = time.perf_counter()
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        ms = cuda_time(step, a.steps)
        host = host_ms(step, max(1, a.steps // 2))
    except torch.OutOfMemoryError as e:
        return dict(phase=phase, path=path, error=f"OOM {str(e)[:80]}")
    tf = flop / ms / 1e9
    row = dict(phase=phase, path=path, param_dtype="fp32+autocast" if a.fp32_params else "bf16", cuda_graph=graph,
               note=f"no CUDA graph: {no_graph}" if no_graph else "",
               ms=ms, host_ms=host, tok_s=a.tokens / ms * 1e3, tflops=tf,
               mfu_sustained=tf / peaks[0], mfu_burst=tf / peaks[1], mfu_datasheet=tf / 989,
               peak_gb=torch.cuda.max_memory_allocated() / 2 ** 30, warmup_s=warm_s, flops=flop, **parts)
    if a.profile and path == a.paths.split(",")[-1]:
        row["profile"] = profile(step, phase, path, a)
    if a.sync_trace:
        row["sync_trace"] = sync_trace(step)
    del model, step
    torch.cuda.empty_cache()
    return row


def profile(step, phase: str, path: str, a) -> dict:
    """torch.profiler over ``--profile-steps`` steps: a Chrome trace, the top GPU kernels, the ops with the
    most self CPU time (``table_host_*.txt``), kernel launches per step, CPU vs GPU time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = Path(a.profile)
    out.mkdir(parents=True, exist_ok=True)
    n = a.profile_steps
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / f"trace_{phase}_{path}.json"))
    events = prof.key_averages()
    dev = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    cpu_ms, gpu_ms = (x / n for x in host_and_device_ms(events))  # each event once, as the job's profiler
    kernels = sorted((e for e in events if dev(e) > 0 and e.self_cpu_time_total == 0), key=dev, reverse=True)
    top = [dict(name=e.key[:90], ms_per_step=dev(e) / 1e3 / n, calls_per_step=e.count / n,
                share=dev(e) / 1e3 / n / gpu_ms if gpu_ms else 0.0) for e in kernels[:a.profile_top]]
    table = events.table(sort_by="self_cuda_time_total", row_limit=a.profile_top, max_name_column_width=60)
    (out / f"table_{phase}_{path}.txt").write_text(table)
    host = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total, reverse=True)
    top_host = [dict(name=e.key[:90], ms_per_step=e.self_cpu_time_total / 1e3 / n, calls_per_step=e.count / n)
                for e in host[:a.profile_top]]
    (out / f"table_host_{phase}_{path}.txt").write_text(
        events.table(sort_by="self_cpu_time_total", row_limit=3 * a.profile_top, max_name_column_width=60))
    launches = sum(e.count for e in events if e.key in LAUNCH_CALLS) / n
    print(f"\nprofile {phase}/{path}: CPU (host ops, GPU waits excluded) {cpu_ms:.1f} ms/step, GPU (kernels) {gpu_ms:.1f} ms/step, "
          f"{launches:.0f} kernel launches/step")
    for k in top:
        print(f"  {k['ms_per_step']:8.2f} ms {100 * k['share']:5.1f}%  x{k['calls_per_step']:<6.0f} {k['name']}")
    print(f"host: the {len(top_host)} ops with the most self CPU time per step")
    for k in top_host:
        print(f"  {k['ms_per_step']:8.2f} ms  x{k['calls_per_step']:<6.0f} {k['name']}")
    return dict(cpu_ms_per_step=cpu_ms, gpu_ms_per_step=gpu_ms, launches_per_step=launches, top_kernels=top,
                top_host=top_host, trace=str(out))


def sync_trace(step) -> dict[str, int]:
    """Run ``step`` once and count where the host waited on the GPU (``step_profile.host_waits``), keyed by the
    innermost three v4launch / benchmark frames."""
    def where(stack) -> str:
        frames = [f for f in stack if "v4launch" in f.filename or "benchmarks" in f.filename]
        return " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:][::-1]) or "(no frame)"

    seen = host_waits(step, where)
    print(f"\nsync trace: {sum(seen.values())} host synchronisations in one step")
    for place, n in seen.most_common():
        print(f"  x{n:<3d} {place}")
    return dict(seen)


def _loss_and_grads(model: V4Model, batch) -> tuple[float, torch.Tensor]:
    tokens, cu, max_seqlen, labels, _ = batch
    loss = total_loss(model(tokens, cu, max_seqlen, labels))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = torch.cat([(g if g is not None else torch.zeros_like(p)).double().flatten() for p, g in zip(params, grads)])
    return float(loss.detach()), flat


def parity(a) -> list[dict]:
    """bf16 error of each path against the float32 reference path, judged relative to the reference's own."""
    args = make_args()
    batch = make_batch(args, a.parity_tokens, min(a.seg, a.parity_tokens), False, seed=1)
    rows = []
    model32 = use_path(build_model(args, a.parity_phase, torch.float32), "reference")
    truth_loss, truth = _loss_and_grads(model32, batch)
    for path in a.paths.split(","):
        model16 = use_path(copy.deepcopy(model32).to(torch.bfloat16), path)
        loss, grads = _loss_and_grads(model16, batch)
        rows.append(dict(path=path, loss=loss, truth_loss=truth_loss, loss_err=abs(loss - truth_loss) / abs(truth_loss),
                         grad_err=float((grads - truth).norm() / truth.norm())))
        del model16
    ref = next((r for r in rows if r["path"] == "reference"), None)
    for r in rows:
        r["limit"] = None if ref is None else dict(loss_err=PARITY_LIMIT * ref["loss_err"],
                                                   grad_err=PARITY_LIMIT * ref["grad_err"])
        r["ok"] = None if ref is None else (r["loss_err"] <= r["limit"]["loss_err"]
                                            and r["grad_err"] <= r["limit"]["grad_err"])
    del model32
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- report
def print_table(rows: list[dict], peaks: tuple[float, float]) -> None:
    print(f"\nbf16 matmul peak measured here: sustained {peaks[0]:.0f} TFLOP/s, burst {peaks[1]:.0f} TFLOP/s")
    head = f"{'phase':7s} {'path':9s} {'ms/step':>8s} {'host ms':>8s} {'tokens/s':>9s} {'TFLOP/s':>8s} " \
           f"{'MFU sust':>8s} {'MFU burst':>9s} {'peak GB':>8s} {'params':>13s}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['phase']:7s} {r['path']:9s} {r['error']}")
            continue
        print(f"{r['phase']:7s} {r['path']:9s} {r['ms']:8.1f} {r['host_ms']:8.1f} {r['tok_s']:9.0f} "
              f"{r['tflops']:8.1f} {100 * r['mfu_sustained']:7.1f}% {100 * r['mfu_burst']:8.1f}% {r['peak_gb']:8.1f} "
              f"{r['param_dtype']:>13s}" + (f"  ({r['note']})" if r.get("note") else ""))


def print_parity(rows: list[dict]) -> None:
    print(f"\nbf16 parity against the float32 reference path (limit: {PARITY_LIMIT}x the reference path's bf16 error)")
    for r in rows:
        verdict = "-" if r["ok"] is None else ("ok" if r["ok"] else "FAIL")
        print(f"  {r['path']:9s} loss {r['loss']:.5f} (truth {r['truth_loss']:.5f}) loss err {r['loss_err']:.2e}  "
              f"grad err {r['grad_err']:.2e}  {verdict}")


def environment(a) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, commit=commit, args=vars(a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seg", type=int, default=4096)
    ap.add_argument("--phases", default="dense,warmup,sparse")
    ap.add_argument("--paths", default="kernels", help="comma list of reference,kernels")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, 4 with --compile)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (compile.compile_blocks)")
    ap.add_argument("--cuda-graph", action="store_true", help="capture the whole step in one CUDA graph and replay "
                    "it (the benchmark's batch is fixed; see make_step); the warm-up phase and the reference path "
                    "run without one, as in the product (graph_free), and their rows say so")
    ap.add_argument("--fp32-params", action="store_true", help="float32 parameters, the forward under bf16 autocast "
                    "(the product's precision: float32 AdamW and a cast per weight use); default: bf16 parameters")
    ap.add_argument("--no-wide-gemm", action="store_true")
    ap.add_argument("--no-fused-ce", action="store_true")
    ap.add_argument("--no-fused-mhc", action="store_true")
    ap.add_argument("--no-query-blocks", action="store_true", help="range-only layers' attention backward in the "
                    "single pass, not in query blocks (triton_attention.QUERY_BLOCK_BACKWARD off)")
    ap.add_argument("--span-per-column", type=int, default=None, help="sparse CSA's top-k columns in query "
                    "blocks as a masked span where it is at most this many rows per column "
                    "(triton_attention.SPAN_PER_COLUMN; 0 = never)")
    ap.add_argument("--cu-on-device", action="store_true")
    ap.add_argument("--parity-tokens", type=int, default=2048, help="0 = no parity check")
    ap.add_argument("--parity-phase", default="sparse", choices=["dense", "warmup", "sparse"])
    ap.add_argument("--profile", default="", metavar="DIR", help="write a torch.profiler trace of the last path")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--profile-top", type=int, default=20)
    ap.add_argument("--sync-trace", action="store_true", help="one more step under CUDA sync debug mode: "
                    "where the host waits on the GPU")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    a.warmup = a.warmup if a.warmup is not None else (4 if a.compile else 2)
    matmul.set_wide_gemm(not a.no_wide_gemm)
    loss_mod.set_fused_head(not a.no_fused_ce)
    mhc.set_fused_mixing(not a.no_fused_mhc)
    from v4launch.model.kernels import triton_attention

    triton_attention.QUERY_BLOCK_BACKWARD = not a.no_query_blocks
    if a.span_per_column is not None:
        triton_attention.SPAN_PER_COLUMN = a.span_per_column
    peaks = matmul_peaks()
    res = dict(env=environment(a), peak_tflops_sustained=peaks[0], peak_tflops_burst=peaks[1], rows=[], parity=[])
    for phase in a.phases.split(","):
        for path in a.paths.split(","):
            res["rows"].append(measure(phase, path, a, peaks))
            print_table(res["rows"][-1:], peaks)
    if a.parity_tokens:
        res["parity"] = parity(a)
    print_table(res["rows"], peaks)
    if res["parity"]:
        print_parity(res["parity"])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "train_step.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
