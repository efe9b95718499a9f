"""Whole training step of a ~1.1B-parameter V4-shaped model on one GPU: tokens/s and MFU.

    python benchmarks/train_step.py [--tokens 8192] [--seg 4096] [--phase sparse] [--steps 3]

Model: ModelArgs with V4 structure scaled down (dim 1024, 8 layers SWA/CSA/HCA + 1 MTP,
16 heads x 512, rope 64, window 128, indexer 16 x 128 top-512, 24 routed experts top-4 +
1 shared, mHC 4, vocab 129280), bf16 parameters, fused AdamW. One step = forward +
backward + optimizer step (+ router-bias update). Attention runs twice: the reference
module, and the kernel path (``Attention.forward`` routed through
``v4launch.model.kernels.attention_forward`` with the triton backend).

FLOPs per step (MFU numerator):
  6 * N_active * T                          (matmul params touched per token: everything
                                             except the embedding table; routed experts
                                             counted at top-k / E; head and MTP included)
  + 12 * H * D * sum_t n_cand(t) per layer  (attention core fwd 4HD + bwd 8HD per candidate)
  + 2 * H_I * d_I * sum_t n_visible(t) per CSA layer (indexer scoring, forward only)
MFU = FLOPs / step time / measured bf16 matmul peak (also given against 989 TFLOP/s datasheet).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import DEV, cuda_time, load_model_package, matmul_peak  # noqa: E402

M = load_model_package()
from v4launch.model import ModelArgs, V4Model  # noqa: E402
from v4launch.model.attention import Attention  # noqa: E402
from v4launch.model.kernels import attention_forward, select_backend  # noqa: E402

RATIOS = (0, 4, 128, 4, 128, 4, 128, 4, 0)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seg", type=int, default=4096)
    ap.add_argument("--phase", default="sparse", choices=["dense", "warmup", "sparse"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--paths", default="reference,kernels")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of one kernel-path step")
    a = ap.parse_args()
    peak = matmul_peak()
    args = make_args()
    torch.manual_seed(0)
    model = V4Model(args, "dense").to(DEV)
    if a.phase != "dense":
        model.set_phase("warmup")
        if a.phase == "sparse":
            model.set_phase("sparse")
    model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    T = a.tokens
    lengths = [a.seg] * (T // a.seg) + ([T % a.seg] if T % a.seg else [])
    tokens = torch.randint(0, args.vocab_size, (T,), device=DEV)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    labels = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
    labels[cu[1:].long() - 1] = -100
    flop, parts = flops_per_step(model, args, lengths)
    orig = Attention.forward
    backend = select_backend("triton", DEV)

    def train_step():
        out = model(tokens, cu, max(lengths), labels)
        loss = out.lm_loss + sum((1.0 if k.startswith("indexer") else 0.01 if k.startswith("balance") else 0.3) * v
                                 for k, v in out.aux_losses.items())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(1e-3)
        return loss

    res = dict(peak_tflops=peak, tokens=T, segments=len(lengths), phase=a.phase, flops=flop, **parts, paths={})
    for path in a.paths.split(","):
        Attention.forward = orig if path == "reference" else (lambda self, x, ctx: attention_forward(self, x, ctx, backend))
        try:
            train_step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms = cuda_time(train_step, a.steps)
            tf = flop / ms / 1e9
            res["paths"][path] = dict(ms=ms, tok_s=T / ms * 1e3, tflops=tf, mfu=tf / peak, mfu_datasheet=tf / 989,
                                      peak_gb=torch.cuda.max_memory_allocated() / 2 ** 30)
        except torch.OutOfMemoryError as e:
            res["paths"][path] = f"OOM {str(e)[:80]}"
        print(path, res["paths"][path], flush=True)
        if a.profile and path == "kernels" and isinstance(res["paths"][path], dict):
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                train_step()
                torch.cuda.synchronize()
            tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=50)
            Path(a.out, "train_step_profile.txt").write_text(tab)
            print(tab, flush=True)
        torch.cuda.empty_cache()
    Attention.forward = orig
    Path(a.out, "train_step.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
