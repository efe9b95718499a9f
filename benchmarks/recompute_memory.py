"""Memory and step time with and without selective recompute (and FP8), on the CPU or one GPU.

    python benchmarks/recompute_memory.py                                   # tiny model, CPU, float32
    python benchmarks/recompute_memory.py --shape bench --device cuda --kernels triton --fp8 none,blockwise \
        --json $OUT/recompute_h200.json

Configurations: every ``--configs`` entry (``none``, ``full`` for whole-layer recompute, or names joined by
``+``, e.g. ``mla_up_proj+layernorm``) under every ``--fp8`` recipe, each on a fresh copy of one seeded model
(``parallel/precision.py``'s ``apply_fp8``, then ``parallel/recompute.py``'s ``apply_recompute``, as the
job applies them). One step = forward + backward of the packed batch + AdamW step + router-bias
update, as the job's step; parameters float32, bf16 autocast on CUDA (as the job's ``precision.dtype:
bf16``), ``--dtype`` on the CPU.

Columns:
  saved MiB      bytes of the distinct storages autograd keeps for backward during the forward
                 (``torch.autograd.graph.saved_tensors_hooks``; a recomputed region keeps its inputs
                 only). The CPU memory figure (the process's RSS is not the tensors' memory).
  peak MiB       CUDA only: ``torch.cuda.max_memory_allocated`` during the step minus the memory
                 allocated before it (activations, gradients, optimizer temporaries); total = peak of
                 the whole process (parameters and optimizer state included).
  ms/step        median over the timed steps (CUDA events on the GPU, wall clock on the CPU).
  loss           training loss at the first and last step on a learnable token stream (a fixed sparse
                 bigram chain over 512 token ids, the same batches for every configuration): FP8
                 runs should track the bf16 run.

Shapes: ``tiny`` (tests/model/v4_helpers.py's model with 16-aligned dimensions: dim 32, 4 layers + 1
MTP) and ``bench`` (recipes/bench_h200.yaml's model: dim 1024, 8 layers + 1 MTP, 16 heads x 512,
24 routed experts top-4 + 1 shared, vocab 129,280; 1.1 B parameters: GPU only in practice).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import load_model_package  # noqa: E402

M = load_model_package()
from v4launch.model import ModelArgs, V4Model  # noqa: E402
from v4launch.model.parallel.precision import apply_fp8  # noqa: E402
from v4launch.model.parallel.recompute import apply_recompute  # noqa: E402

SHAPES = {
    "tiny": dict(vocab_size=512, dim=32, n_layers=4, n_mtp_layers=1, compress_ratios=(0, 4, 128, 4, 0), n_heads=4,
                 head_dim=16, rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, window_size=8,
                 index_n_heads=8, index_head_dim=16, index_topk=3, n_routed_experts=4, n_activated_experts=2,
                 n_shared_experts=1, moe_inter_dim=32, n_hash_layers=1, hc_mult=2, original_seq_len=64,
                 rope_factor=4.0),
    "bench": dict(vocab_size=129280, dim=1024, n_layers=8, n_mtp_layers=1, compress_ratios=(0, 4, 128, 4, 128, 4, 128,
                  4, 0), n_heads=16, head_dim=512, rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512,
                  window_size=128, index_n_heads=16, index_head_dim=128, index_topk=512, n_routed_experts=24,
                  n_activated_experts=4, n_shared_experts=1, moe_inter_dim=1024, n_hash_layers=1, hc_mult=4,
                  original_seq_len=4096, rope_factor=16.0),
}


class Precision:
    """The bits of a recipe's ``precision`` section that ``apply_fp8`` reads (no pydantic needed on the GPU box)."""

    class policy:  # noqa: N801  (the recipe's field name)
        compressor_gemm = indexer_weights_proj = indexer_qk = "bf16"
        ape = attn_sink = "fp32"

    fp8_dispatch = True  # no EP here: no effect

    def __init__(self, fp8_recipe: str, dtype: str) -> None:
        self.fp8_recipe, self.dtype = fp8_recipe, dtype


def bigram_stream(vocab: int, seed: int = 1234):
    """A learnable token source: each of 512 ids has 4 possible successors (entropy <= ln 4 nats/token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:512]
    nxt = torch.randint(0, 512, (512, 4), generator=g)

    succ = nxt.tolist()

    def batch(T: int, seg: int, step: int):
        gs = torch.Generator().manual_seed(seed + 1 + step)
        lengths = [seg] * (T // seg) + ([T % seg] if T % seg else [])
        choice = torch.randint(0, 4, (T,), generator=gs).tolist()
        state, out = int(torch.randint(0, 512, (1,), generator=gs)), []
        for c in choice:
            out.append(state)
            state = succ[state][c]
        tokens = ids[torch.tensor(out)]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        labels = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
        labels[cu[1:].long() - 1] = -100
        return tokens, cu, max(lengths), labels
    return batch


def saved_bytes(fn):
    """(bytes of distinct storages saved for backward while ``fn()`` runs, fn's result)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def run_config(base: V4Model, names: list[str], fp8: str, a, batches, device: torch.device) -> dict:
    model = copy.deepcopy(base)
    cuda = device.type == "cuda"
    converted = apply_fp8(model, Precision(fp8, "bf16" if cuda else a.dtype), emulate=not cuda) if fp8 != "none" else []
    regions = apply_recompute(model, names)
    if a.compile:
        from v4launch.model.compile import compile_blocks
        compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=cuda)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    times, losses, saved, peaks, totals = [], [], [], [], []
    for step, (tokens, cu, max_len, labels) in enumerate(batches):
        tokens, labels = tokens.to(device), labels.to(device)
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
        start = time.perf_counter()
        with autocast:  # (the saved-tensor hooks stay out of compiled regions)
            kept, out = (0, model(tokens, cu, max_len, labels)) if a.compile else \
                saved_bytes(lambda: model(tokens, cu, max_len, labels))
            loss = out.lm_loss + sum(out.aux_losses.values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(1e-3)
        if cuda:
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1))
            peaks.append(torch.cuda.max_memory_allocated() - before)
            totals.append(torch.cuda.max_memory_allocated())
        else:
            times.append(1e3 * (time.perf_counter() - start))
        losses.append(out.lm_loss.item())
        saved.append(kept)
    timed = times[a.warmup:] or times
    mib = 2.0 ** 20
    return dict(recompute="+".join(names) or "none", fp8=fp8, regions=len(regions), fp8_modules=len(converted),
                saved_mib=round(saved[-1] / mib, 1), peak_mib=round(max(peaks[a.warmup:] or peaks) / mib, 1)
                if peaks else None, total_mib=round(max(totals) / mib, 1) if totals else None,
                ms_step=round(statistics.median(timed), 2), loss_first=round(losses[0], 4),
                loss_last=round(losses[-1], 4), losses=[round(v, 4) for v in losses])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "fp64"], default="fp32", help="CPU parameter dtype (CUDA: fp32 + bf16 autocast)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (tiny 512, bench 8192)")
    p.add_argument("--seg", type=int, default=None, help="segment length of the packs (default tokens / 2)")
    p.add_argument("--phase", choices=["dense", "warmup", "sparse"], default="sparse")
    p.add_argument("--kernels", choices=["reference", "triton"], default="reference")
    p.add_argument("--configs", default="none,layernorm,mla_up_proj,moe_act,shared_experts,moe,"
                                        "layernorm+mla_up_proj+moe_act+shared_experts")
    p.add_argument("--fp8", default="none", help="comma list of precision.fp8_recipe values (CPU: torchao emulation)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true", help="compile.compile_blocks after the conversions")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    args = ModelArgs(**SHAPES[a.shape])
    T = a.tokens or (512 if a.shape == "tiny" else 8192)
    torch.manual_seed(0)
    base = V4Model(args, "dense", chunk_size=256, kernel_backend=a.kernels)
    for later in ("warmup", "sparse")[: ("dense", "warmup", "sparse").index(a.phase)]:
        base.set_phase(later)
    base = base.to(device=device, dtype=torch.float64 if (a.dtype == "fp64" and device.type == "cpu") else torch.float32)
    stream = bigram_stream(args.vocab_size)
    batches = [stream(T, a.seg or T // 2, s) for s in range(a.steps)]
    rows = []
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               shape=a.shape, tokens=T, phase=a.phase, kernels=a.kernels, steps=a.steps, warmup=a.warmup,
               compile=a.compile, threads=torch.get_num_threads())
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"{'recompute':<46} {'fp8':<9} {'regions':>7} {'saved MiB':>10} {'peak MiB':>9} {'total MiB':>9} "
          f"{'ms/step':>9} {'loss first -> last':>18}")
    for fp8 in a.fp8.split(","):
        for cfg in a.configs.split(","):
            names = [] if cfg == "none" else cfg.split("+")
            r = run_config(base, names, fp8, a, batches, device)
            rows.append(r)
            print(f"{r['recompute']:<46} {fp8:<9} {r['regions']:>7} {r['saved_mib']:>10} {str(r['peak_mib']):>9} "
                  f"{str(r['total_mib']):>9} {r['ms_step']:>9} {r['loss_first']:>8} -> {r['loss_last']:<8}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(dict(env=env, rows=rows), indent=1))


if __name__ == "__main__":
    main()
