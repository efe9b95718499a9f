"""Harness for the context-parallel tests: spawn gloo ranks, run CP and CP=1 on one batch, compare.

Every rank builds the same seeded module and batch, runs the CP=1 reference on the whole
batch itself, then the CP run on its contiguous slice; it reports max errors of its local
outputs and input gradients, of the CP-summed parameter gradients and of the losses, plus
its traffic records. A uniquely named module so no other conftest shadows it.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/model (v4_helpers)

from v4_helpers import build, gloo_spawn, packed_batch, randomize, tiny_args  # noqa: E402

from v4launch.model import model as model_module  # noqa: E402
from v4launch.model.attention import Attention, BatchContext  # noqa: E402
from v4launch.model.kernels import dispatch  # noqa: E402
from v4launch.model.packing import make_pack  # noqa: E402
from v4launch.model.parallel import ContextParallelGroup, shard_thd_batch  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def spawn(world: int, cases: list[dict], tmp_path) -> list[list[dict]]:
    """Run ``cases`` (each with ``kind``: "layer", "model" or "errors") on ``world`` gloo ranks.

    Returns results[rank][case index]."""
    return gloo_spawn(world, cases, tmp_path, run_case)


def run_case(case: dict) -> dict:
    """One case on this rank (dispatched by its contents)."""
    return {"layer": layer_case, "model": model_case, "errors": error_case,
            "gather_dtypes": gather_dtypes_case}[case["kind"]](case)


def gather_dtypes_case(case: dict) -> dict:
    """The entry all-gather of two parts of two dtypes (a float32 compressed KV beside bf16 indexer keys, as a
    CSA first layer under autocast has them): the dtype each gathered part comes back in, and whether every
    rank's rows of each part are its own values (``capacity`` rows per rank, the last one padding)."""
    from types import SimpleNamespace

    cp = ContextParallelGroup()
    own, cap = 3, 4
    gen = torch.Generator().manual_seed(case["seed"] + cp.rank)
    parts = [torch.randn(own, 5, generator=gen), torch.randn(own, 2, generator=gen).to(torch.bfloat16)]
    plan = SimpleNamespace(capacity=cap, phys=torch.arange(cp.size * cap))
    mems = cp.gather(parts, plan, None, "dtypes")
    mine = slice(cp.rank * cap, cp.rank * cap + own)
    return dict(dtypes=[str(m.buf.dtype) for m in mems],
                own_rows=all(bool(torch.equal(m.buf[mine], p)) for m, p in zip(mems, parts)))


def stand_in_fused_backend() -> dispatch.Backend:
    """The reference kernel functions under a fused backend's name: a model or layer given it runs
    the kernel-path layer code (``kernels.layer.attention_forward``) on the CPU, in float64, the warm-up KL
    included (``layer._DenseKL``)."""
    return dataclasses.replace(dispatch.select_backend("reference", "cpu"), name="triton",
                               dense_kl_fused=lambda *a: True)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| relative to max(1, max |b|)."""
    return (a.detach() - b.detach()).abs().max().item() / max(1.0, b.detach().abs().max().item()) if b.numel() else 0.0


def _reduced_grad_err(cp: ContextParallelGroup, module: torch.nn.Module, ref: dict) -> tuple[float, str]:
    """All-reduce (SUM) every parameter gradient over CP (None as zero) and compare with ``ref``."""
    worst, name_w = 0.0, ""
    for name, p in module.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.contiguous().clone()
        dist.all_reduce(g, group=cp.comm.group)
        r = ref[name] if ref[name] is not None else torch.zeros_like(p)
        e = _err(g, r)
        if e >= worst:
            worst, name_w = e, name
    return worst, name_w


def layer_case(case: dict) -> dict:
    """One attention layer (ratio case["ratio"], phase case["phase"]) at CP = world vs CP = 1."""
    dtype, ratio, phase = DTYPES[case.get("dtype", "float64")], case["ratio"], case["phase"]
    ratios = tuple(case.get("ratios", (ratio,)))
    args = tiny_args(n_layers=len(ratios), n_mtp_layers=0, compress_ratios=ratios, **case.get("args", {}))
    gen = torch.Generator().manual_seed(case["seed"])
    attn = Attention(0, args, with_indexer=phase != "dense").to(dtype)
    randomize(attn, gen)
    tokens, cu, max_len, _ = packed_batch(case["lengths"], args.vocab_size, gen)
    T = tokens.numel()
    x = torch.randn(T, args.dim, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(T, args.dim, generator=gen, dtype=torch.float64).to(dtype)
    kl_target = "visible" if phase == "warmup" else "selected"
    chunk = case.get("chunk", 16)

    def loss_of(out, kl, rows):
        return (out * w[rows]).sum() + (kl if kl is not None else 0.0)

    xr = x.clone().requires_grad_()
    out_r, kl_r = attn(xr, BatchContext(make_pack(tokens, cu, max_len), args.window_size, kl_target, chunk))
    loss_of(out_r, kl_r, slice(None)).backward()
    ref_grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in attn.named_parameters()}
    attn.zero_grad(set_to_none=True)

    cp = ContextParallelGroup()
    local = shard_thd_batch(tokens, None, cu, cp.rank, cp.size)
    rows = slice(local.start, local.start + T // cp.size)
    shard = cp.shard(local.tokens, local.cu_seqlens, max_len, args.window_size, args.compress_ratios)
    xl = x[rows].clone().requires_grad_()
    kernels = stand_in_fused_backend() if case.get("kernels") else None  # CP run on the kernel-path layer code
    ctx = BatchContext(shard.pack, args.window_size, kl_target, chunk, cp, shard, kernels=kernels)
    out_c, kl_c = attn(xl, ctx)
    loss_of(out_c, kl_c, rows).backward()
    grad_err, grad_name = _reduced_grad_err(cp, attn, ref_grads)
    plan = ctx.plan(ratio) if ratio else None
    traffic = list(cp.traffic.records)  # one forward + backward of the layer
    kl_only = None
    if kl_r is not None:  # the indexer loss alone: it reaches indexer parameters only, on every rank
        attn.zero_grad(set_to_none=True)
        full_ctx = BatchContext(make_pack(tokens, cu, max_len), args.window_size, kl_target, chunk)
        attn(x.clone().requires_grad_(), full_ctx)[1].backward()
        ref_kl = {n: (p.grad.clone() if p.grad is not None else None) for n, p in attn.named_parameters()}
        attn.zero_grad(set_to_none=True)
        attn(x[rows].clone().requires_grad_(), BatchContext(shard.pack, args.window_size, kl_target, chunk, cp,
                                                             shard, kernels=kernels))[1].backward()
        kl_only = _reduced_grad_err(cp, attn, ref_kl)[0]
    return dict(
        out=_err(out_c, out_r[rows]), x_grad=_err(xl.grad, xr.grad[rows]), param_grad=grad_err, worst=grad_name,
        kl=None if kl_r is None else abs(kl_c.item() - kl_r.item()), kl_value=None if kl_r is None else kl_r.item(),
        kl_only_grad=kl_only,
        owned=0 if plan is None else int(plan.start.numel()), entries=0 if plan is None else plan.n_entries,
        capacity=0 if plan is None else plan.capacity, local_rows=T // cp.size, boundary=shard.left,
        traffic=traffic)


def model_case(case: dict) -> dict:
    """The whole tiny model (SWA+hash, CSA, HCA, CSA, MTP) in ``case["phase"]`` at CP = world vs CP = 1."""
    dtype = DTYPES[case.get("dtype", "float64")]
    args = tiny_args(**case.get("args", {}))
    gen = torch.Generator().manual_seed(case["seed"])
    model = build(args, case["phase"], gen, dtype=dtype, chunk_size=case.get("chunk", 32))
    tokens, cu, max_len, labels = packed_batch(case["lengths"], args.vocab_size, gen)

    def total(out):
        return out.lm_loss + sum(out.aux_losses.values())

    ref = model(tokens, cu, max_len, labels, return_logits=True)
    total(ref).backward()
    ref_grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    cp = ContextParallelGroup()
    model.cp = cp
    if case.get("kernels"):  # the CP run on the kernel-path layer code
        model_module.select_backend = lambda name, device: stand_in_fused_backend()
        model.set_kernel_backend("triton")
    local = shard_thd_batch(tokens, labels, cu, cp.rank, cp.size)
    out = model(local.tokens, local.cu_seqlens, max_len, local.labels, return_logits=True)
    total(out).backward()
    rows = slice(local.start, local.start + local.tokens.numel())
    grad_err, grad_name = _reduced_grad_err(cp, model, ref_grads)
    if case.get("control"):  # the same run without the right-neighbour row: the MTP loss must change
        cp.next_first = lambda x, fill: None
        with torch.no_grad():
            broken = model(local.tokens, local.cu_seqlens, max_len, local.labels)
        control = abs(broken.aux_losses["mtp/depth_1"].item() - ref.aux_losses["mtp/depth_1"].item())
    losses = {"lm": abs(out.lm_loss.item() - ref.lm_loss.item())}
    losses.update({k: abs(v.item() - ref.aux_losses[k].item()) for k, v in out.aux_losses.items()})
    return dict(logits=_err(out.logits, ref.logits[rows]), param_grad=grad_err, worst=grad_name, losses=losses,
                loss_names=sorted(out.aux_losses), ref_names=sorted(ref.aux_losses),
                control=control if case.get("control") else None, traffic=cp.traffic.records)


def error_case(case: dict) -> dict:
    """The ValueError messages of ContextParallelGroup.shard (CP = world)."""
    cp = ContextParallelGroup()
    msgs = {}
    L, width = case["local"], case["width_window"]
    try:
        cp.shard(torch.zeros(L, dtype=torch.long), torch.tensor([0, L * cp.size]), L * cp.size, width, (0,))
    except ValueError as e:
        msgs["short"] = str(e)
    try:
        cp.shard(torch.zeros(64, dtype=torch.long), torch.tensor([0, 100]), 100, 8, (4,))
    except ValueError as e:
        msgs["global"] = str(e)
    return msgs
