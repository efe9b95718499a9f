"""Context-parallel scaling of one V4-Flash attention layer of each type (SWA, CSA sparse, HCA).

    # one GPU per rank, NCCL; CP = world size (N = 1, 2, 4, ...)
    torchrun --standalone --nproc-per-node N benchmarks/cp_scaling.py --sizes 65536,131072 --out cpN.json
    # memory gates and scaling, from several runs (no torchrun needed)
    python benchmarks/cp_scaling.py --compare cp1.json cp2.json cp4.json
    # CPU smoke test: gloo, tiny dims
    torchrun --standalone --nproc-per-node 2 benchmarks/cp_scaling.py --tiny --sizes 256,512 --parity-T 512

What it does, per rank (CP group = the whole world, the runtime of docs/context_parallel.md):

* builds the model's own ``Attention`` (layer 0 = SWA, 2 = CSA with indexer in the sparse
  phase, 3 = HCA of the Flash schedule; ``ModelArgs()`` = V4-Flash: dim 4096, 64 heads x 512,
  rope 64, window 128, indexer 64 x 128 top-512, o_groups 8), bf16, identical on every rank
  (broadcast from rank 0), and runs it on the rank's contiguous slice of ONE packed segment
  of T tokens through ``ContextParallelGroup`` / ``cp.shard`` / ``BatchContext(..., cp, shard)``
  -- the path of ``tests/model/cp/cp_harness.py`` and of the training job (reference
  attention, or the fused kernels with ``--kernels triton``);
* times forward and backward (CUDA events; warm-up steps, then the median of repeats),
  reports tokens/s/GPU = (T / cp) / (slowest rank's fwd+bwd), peak memory per rank
  (``torch.cuda.max_memory_allocated`` over the timed steps, parameters and inputs included);
* counts the bytes of every collective of one forward + backward with the runtime's counter
  (``cp.traffic``) and prints them beside the validator's figures
  (``v4launch.validators.derived``: boundary width x dim, ``padded_allgather_bytes``,
  ``csa_allgather_bytes`` / ``hca_allgather_bytes``); the collectives are then timed by a
  separate replay of the same calls on tensors of the recorded sizes (events, median);
* parity (``--parity-T``): every rank runs the CP = 1 layer on the whole batch on its own
  device (the single-device path, no CP object), then CP = world on its slice, and compares
  its local outputs, its slice of the input gradient, the KL and the CP-summed parameter
  gradients: bf16 cosine similarity >= 1 - 1e-3, float32 relative L2 <= 1e-4;
* with NCCL, checks the job's process-group setup: ``v4launch.training.dist`` initialises
  ``backend="nccl"`` alone, and the runtime's ``sum_int`` all-reduces a CPU tensor; the probe
  runs that call on an NCCL-only group and reports whether it works. The benchmark itself
  uses ``cpu:gloo,cuda:nccl`` so that it runs either way (``--backend`` overrides).

Upstream memory gates, checked by ``--compare``: per-rank peak at CP = 2 < 0.65 x CP = 1, at
CP = 4 < 0.35 x CP = 1 (same layer, same T). Rank 0 prints markdown tables; ``--out`` writes json.
Runs without the package installed: ``v4launch.model`` then maps to ./model and
``v4launch.validators.derived`` to ./validators/derived.py (no pydantic needed).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _shim() -> None:
    """Map ``v4launch.model`` to ./model and ``v4launch.validators`` to ./validators without
    running ``v4launch/__init__`` or ``validators/__init__`` (which imports pydantic)."""
    if os.environ.get("V4_SHIM") != "1" and importlib.util.find_spec("v4launch") is not None:
        try:
            import v4launch.model  # noqa: F401
            import v4launch.validators.derived  # noqa: F401
            return
        except ImportError:
            for k in [k for k in sys.modules if k == "v4launch" or k.startswith("v4launch.")]:
                del sys.modules[k]
    root = types.ModuleType("v4launch")
    root.__path__ = []
    sys.modules["v4launch"] = root
    val = types.ModuleType("v4launch.validators")
    val.__path__ = [str(REPO / "validators")]
    sys.modules["v4launch.validators"] = val
    root.validators = val
    spec = importlib.util.spec_from_file_location("v4launch.model", REPO / "model" / "__init__.py",
                                                  submodule_search_locations=[str(REPO / "model")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["v4launch.model"] = mod
    root.model = mod
    spec.loader.exec_module(mod)


_shim()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from v4launch.model import ModelArgs  # noqa: E402
from v4launch.model import attention as attention_module  # noqa: E402
from v4launch.model.attention import Attention, BatchContext  # noqa: E402
from v4launch.model.packing import make_pack  # noqa: E402
from v4launch.model.parallel import ContextParallelGroup  # noqa: E402
from v4launch.model.parallel.comm import AllGather  # noqa: E402
from v4launch.validators.derived import (boundary_width, csa_allgather_bytes, hca_allgather_bytes,  # noqa: E402
                                         padded_allgather_bytes)

LAYERS = {  # name: (layer id in the schedule, indexer, KL target, phase)
    "SWA": (0, False, "selected", "-"),
    "CSA": (2, True, "selected", "sparse"),
    "HCA": (3, False, "selected", "-"),
}
GATES = {2: 0.65, 4: 0.35}  # per-rank peak memory at CP = n must stay below GATES[n] x the CP = 1 peak
BF16_COS = 1e-3  # bf16 parity: cosine similarity >= 1 - BF16_COS
FP32_REL = 1e-4  # float32 parity: relative L2 error <= FP32_REL
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def tiny_args() -> ModelArgs:
    """Tiny V4-shaped layers with the Flash schedule's first layer ids (0 SWA, 2 CSA, 3 HCA)."""
    return ModelArgs(vocab_size=61, dim=32, n_layers=4, n_mtp_layers=0, compress_ratios=(0, 0, 4, 128),
                     n_heads=4, head_dim=16, rope_head_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=12,
                     window_size=8, index_n_heads=8, index_head_dim=16, index_topk=4, original_seq_len=64,
                     rope_factor=4.0, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=24,
                     n_hash_layers=1, hc_mult=2)


# ---------------------------------------------------------------------------------------- runtime helpers
class Env:
    def __init__(self, a):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cuda = a.device == "cuda"
        self.dev = torch.device(f"cuda:{torch.cuda.current_device()}") if self.cuda else torch.device("cpu")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


class Clock:
    """Elapsed milliseconds between marks: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def gather_obj(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree(env: Env, flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on rank 0 (rank 0 decides)."""
    t = torch.tensor([1 if flag else 0], device=env.dev)
    dist.broadcast(t, 0)
    return bool(t.item())


def build_layer(name: str, args: ModelArgs, dtype, env: Env, seed: int = 0) -> Attention:
    lid, indexer, _, _ = LAYERS[name]
    torch.manual_seed(seed)
    attn = Attention(lid, args, with_indexer=indexer)  # built on the CPU (seeded), as benchmarks/attention.py
    with torch.no_grad():
        attn.attn_sink.normal_(0, 0.5)
        for n, p in attn.named_parameters():
            if n.endswith("ape"):
                p.normal_(0, 0.5)
            elif "norm" in n:
                p.normal_(1.0, 0.1)
    attn = attn.to(env.dev).to(dtype)
    with torch.no_grad():  # identical on every rank whatever the device RNG does
        for t in list(attn.parameters()) + list(attn.buffers()):
            if t.is_floating_point():
                dist.broadcast(t.data, 0)
    return attn


KERNELS = {"name": "reference"}  # --kernels: the attention kernels of the CP = world runs


def make_ctx(args, name, shard, cp, chunk):
    """The CP = world batch context; with ``--kernels triton`` it carries the fused backend, so the
    layer runs ``kernels.layer.attention_forward`` (the CP = 1 parity side stays the reference path)."""
    kernels = None
    if KERNELS["name"] != "reference":
        from v4launch.model.kernels.dispatch import select_backend

        backend = select_backend(KERNELS["name"], shard.pack.pos.device)
        kernels = None if backend.name == "reference" else backend
    return BatchContext(shard.pack, args.window_size, LAYERS[name][2], chunk, cp, shard, kernels=kernels)


def backward(out, kl, g):
    ts, gs = [out], [g]
    if kl is not None:
        ts.append(kl)
        gs.append(torch.ones_like(kl))
    torch.autograd.backward(ts, gs)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


# ---------------------------------------------------------------------------------------- parity
def parity_lengths(T: int) -> list[int]:
    """Three segments whose boundaries fall inside ranks for cp in 1, 2, 4, 8; tails not multiples of 4."""
    a = 5 * T // 8 + 37
    b = T // 4 - 50
    return [a, b, T - a - b]


def compare(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, relative L2 error) in float64; two zero tensors count as equal."""
    a, b = x.detach().double().flatten(), ref.detach().double().flatten()
    na, nb = a.norm().item(), b.norm().item()
    if nb == 0.0:
        return (1.0, 0.0) if na == 0.0 else (0.0, math.inf)
    cos = (a @ b).item() / max(na * nb, 1e-300)
    return cos, (a - b).norm().item() / nb


class SelectionRecorder:
    """Records the indexer's top-k selection of every query row while active.

    ``rows[global row] = frozenset of logical entry ids``; ``offset`` maps the rank's local rows
    to global ones. Used by the parity check to tell a rounding difference from a selection
    flip: two near-tied indexer scores computed in a different GEMM shape (CP changes the
    query rows per chunk) can swap one entry at the top-k boundary, which moves that row's
    attention and the KL gradient by far more than rounding.
    """

    def __init__(self, offset: int = 0):
        self.offset, self.rows = offset, {}

    def __enter__(self):
        self._orig = attention_module.select_topk
        attention_module.select_topk = self._select
        return self

    def __exit__(self, *exc):
        attention_module.select_topk = self._orig

    def _select(self, inp, vis_idx, vis_valid, rows, topk, lo, hi):
        idx, valid = self._orig(inp, vis_idx, vis_valid, rows, topk, lo, hi)
        for r, (ids, ok) in enumerate(zip((idx + lo).tolist(), valid.tolist())):
            self.rows[self.offset + rows.start + r] = frozenset(i for i, v in zip(ids, ok) if v)
        return idx, valid


def parity(name: str, args: ModelArgs, T: int, dtype_name: str, env: Env, cp: ContextParallelGroup, chunk: int):
    dtype = DTYPES[dtype_name]
    attn = build_layer(name, args, dtype, env, seed=1)
    lengths = parity_lengths(T)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=env.dev)
    tokens = torch.zeros(T, dtype=torch.long, device=env.dev)
    gen = torch.Generator(device=env.dev).manual_seed(7)
    x = torch.randn(T, args.dim, device=env.dev, generator=gen).to(dtype)
    g = torch.randn(T, args.dim, device=env.dev, generator=gen).to(dtype)
    dist.broadcast(x, 0)
    dist.broadcast(g, 0)
    target = LAYERS[name][2]
    # CP = 1 on the whole batch (single-device path)
    xr = x.clone().requires_grad_()
    with SelectionRecorder() as sel_r:
        out_r, kl_r = attn(xr, BatchContext(make_pack(tokens, cu, max(lengths)), args.window_size, target, chunk))
    backward(out_r, kl_r, g)
    ref = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in attn.named_parameters()}
    attn.zero_grad(set_to_none=True)
    # CP = world on this rank's slice
    L = T // cp.size
    rows = slice(cp.rank * L, (cp.rank + 1) * L)
    shard = cp.shard(tokens[rows], cu, max(lengths), args.window_size, args.compress_ratios)
    xl = x[rows].clone().requires_grad_()
    with SelectionRecorder(offset=rows.start) as sel_c:
        out_c, kl_c = attn(xl, make_ctx(args, name, shard, cp, chunk))
    flips = sum(sel_c.rows[r] != sel_r.rows.get(r) for r in sel_c.rows)  # rows whose top-k set differs
    backward(out_c, kl_c, g[rows])
    checks = {"out": compare(out_c, out_r[rows]), "x_grad": compare(xl.grad, xr.grad[rows])}
    if kl_r is not None:
        checks["kl"] = compare(kl_c.reshape(1), kl_r.reshape(1))
    worst_p, worst = None, (2.0, -1.0)
    cp_grads = {}
    for n, p in attn.named_parameters():
        gp = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone().contiguous()
        dist.all_reduce(gp, group=cp.comm.group)
        cp_grads[n] = gp
        c = compare(gp, ref[n])
        if c[0] < worst[0] or (c[0] == worst[0] and c[1] > worst[1]):
            worst_p, worst = n, c
    checks["param_grad"] = worst
    truth = None
    if dtype == torch.float32:  # float64 truth: tells rounding amplified by the math from a CP error
        truth = float64_truth(name, args, env, tokens, cu, lengths, x, g, chunk, target,
                              cp1={"out": out_r, "x_grad": xr.grad, **ref},
                              cpn={"out": out_c, "x_grad": xl.grad, **cp_grads}, rows=rows)
    cos = min(c[0] for c in checks.values())
    rel = max(c[1] for c in checks.values())
    ok = cos >= 1 - BF16_COS if dtype == torch.bfloat16 else rel <= FP32_REL
    res = dict(layer=name, phase=LAYERS[name][3], dtype=dtype_name, T=T, lengths=lengths, cp=cp.size,
               rank=cp.rank, min_cos=cos, max_rel=rel, worst_param=worst_p,
               topk_rows=len(sel_c.rows), topk_rows_differing=flips, truth=truth,
               checks={k: dict(cos=v[0], rel=v[1]) for k, v in checks.items()}, ok=ok)
    del attn, x, g, xr, xl, out_r, out_c, ref, cp_grads
    return res


def float64_truth(name, args, env, tokens, cu, lengths, x, g, chunk, target, cp1: dict, cpn: dict,
                  rows: slice) -> dict:
    """The same layer and batch at CP = 1 in float64; returns, for the tensor where CP = N is
    farthest from it, the relative L2 error of CP = N and of CP = 1 (both float32) against it.

    If the two errors are alike, a large CP-vs-CP=1 difference is float32 rounding that the
    layer's math amplifies (e.g. a gradient that is a small difference of large terms), not
    a context-parallel error: CP = N is then as close to the truth as CP = 1 is.
    """
    attn = build_layer(name, args, torch.float64, env, seed=1)
    xt = x.double().requires_grad_()
    out_t, kl_t = attn(xt, BatchContext(make_pack(tokens, cu, max(lengths)), args.window_size, target, chunk))
    backward(out_t, kl_t, g.double())
    truth = {"out": out_t.detach(), "x_grad": xt.grad,
             **{n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in attn.named_parameters()}}
    worst = None
    for n, t in truth.items():
        local = rows if n in ("out", "x_grad") else slice(None)
        e_n = compare(cpn[n], t[local])[1]
        e_1 = compare(cp1[n][local], t[local])[1]
        if worst is None or e_n > worst["cpn_rel"]:
            worst = dict(tensor=n, cpn_rel=e_n, cp1_rel=e_1)
    del attn, xt, out_t, truth
    return worst


def job_backend_probe(env: Env) -> dict:
    """Run the runtime's ``sum_int`` (a CPU int64 all-reduce, used by the LM loss and the indexer
    KL) and ``sum_counts`` on a device tensor over an NCCL-only group, as ``training/dist.py`` builds it."""
    res = {}
    try:
        grp = dist.new_group(backend="nccl")
    except Exception as e:  # noqa: BLE001
        return dict(new_group=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    cpg = ContextParallelGroup(grp)
    for what, fn in (("sum_int(cpu int64)", lambda: cpg.sum_int(3)),
                     ("sum_counts(cuda)", lambda: int(cpg.sum_counts(torch.ones(1, device=env.dev)).item()))):
        try:
            v = fn()
            res[what] = f"ok ({v} == {3 * env.world if 'int' in what else env.world})"
        except Exception as e:  # noqa: BLE001
            res[what] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return res


# ---------------------------------------------------------------------------------------- benchmark
def summarize_traffic(records) -> dict:
    def tot(op, direction, key):
        return sum(r[key] for r in records if r["op"] == op and r["direction"] == direction)

    return dict(boundary_fwd_sent=tot("boundary", "forward", "sent"),
                boundary_fwd_recv=tot("boundary", "forward", "received"),
                boundary_bwd_sent=tot("boundary", "backward", "sent"),
                allgather_fwd_sent=tot("allgather", "forward", "sent"),
                allgather_fwd_recv=tot("allgather", "forward", "received"),
                allgather_bwd=tot("allgather", "backward", "sent"),
                allreduce=tot("allreduce", "forward", "sent"),
                n_allgather=sum(1 for r in records if r["op"] == "allgather"),
                n_boundary=sum(1 for r in records if r["op"] == "boundary"))


def validator_bytes(name: str, args: ModelArgs, T: int, cp: int, elem: int, hidden_elem: int = 2) -> dict:
    lid, indexer = LAYERS[name][0], LAYERS[name][1]
    ratio = args.compress_ratios[lid]
    B = boundary_width(args.window_size, args.compress_ratios)
    v = dict(boundary_width=B, boundary=B * args.dim * hidden_elem if cp > 1 else 0, ratio=ratio)  # hidden rows
    if ratio:
        W = args.head_dim + (args.index_head_dim if indexer else 0)
        v["width"] = W
        v["padded"] = padded_allgather_bytes(T, cp, ratio, W, elem)
        v["padded_bf16"] = padded_allgather_bytes(T, cp, ratio, W)
        v["logical"] = (csa_allgather_bytes(T, kv_dim=args.head_dim, index_dim=args.index_head_dim, elem_bytes=elem)
                        if ratio == 4 else hca_allgather_bytes(T, kv_dim=args.head_dim, elem_bytes=elem))
        v["logical_bf16"] = (csa_allgather_bytes(T, kv_dim=args.head_dim, index_dim=args.index_head_dim)
                             if ratio == 4 else hca_allgather_bytes(T, kv_dim=args.head_dim))
    return v


def replay_collectives(env: Env, cp: ContextParallelGroup, shapes: dict, reps: int) -> dict:
    """Time the layer's collectives again on tensors of the recorded sizes (runtime calls, events)."""
    clock, out = Clock(env.cuda), {}
    comm = cp.comm
    jobs = []
    if shapes.get("boundary"):
        B, dim, dt = shapes["boundary"]
        send = torch.randn(B, dim, device=env.dev).to(dt)
        jobs.append(("boundary_fwd_ms", lambda: comm.shift_right(send, send, "boundary", "replay", "forward")))
        jobs.append(("boundary_bwd_ms", lambda: comm.shift_left(send, send, "boundary", "replay", "backward")))
    if shapes.get("allgather"):
        cap, W, dt = shapes["allgather"]
        buf = torch.randn(cap, W, device=env.dev).to(dt)
        full = torch.randn(cp.size * cap, W, device=env.dev).to(dt)
        jobs.append(("allgather_fwd_ms", lambda: AllGather.apply(buf, comm, "replay")))
        jobs.append(("allgather_bwd_ms", lambda: dist.all_reduce(full.clone(), group=comm.group)))
    with torch.no_grad():
        for key, fn in jobs:
            ts = []
            for i in range(reps + 2):
                dist.barrier()
                env.sync()
                a = clock.mark()
                fn()
                b = clock.mark()
                env.sync()
                if i >= 2:
                    ts.append(clock.ms(a, b))
            out[key] = median(ts)
    comm.traffic.clear()
    return out


def bench_one(name: str, args: ModelArgs, T: int, env: Env, cp: ContextParallelGroup, a) -> dict:
    dtype = DTYPES[a.dtype]
    L = T // cp.size
    row = dict(layer=name, phase=LAYERS[name][3], T=T, cp=cp.size, local_rows=L)
    attn = build_layer(name, args, dtype, env)
    cu = torch.tensor([0, T], dtype=torch.int32, device=env.dev)
    tokens = torch.zeros(L, dtype=torch.long, device=env.dev)
    shard = cp.shard(tokens, cu, T, args.window_size, args.compress_ratios)
    gen = torch.Generator(device=env.dev).manual_seed(100 + cp.rank)
    x = torch.randn(L, args.dim, device=env.dev, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(L, args.dim, device=env.dev, generator=gen).to(dtype)
    clock = Clock(env.cuda)
    fwd, bwd, tot = [], [], []
    last_ctx = None
    if env.cuda:
        env.sync()
        torch.cuda.reset_peak_memory_stats()
        row["base_gib"] = torch.cuda.memory_allocated() / 2 ** 30
    repeats, i = a.repeats, 0
    while i < a.warmup + repeats:
        attn.zero_grad(set_to_none=True)
        x.grad = None
        cp.traffic.clear()
        ctx = make_ctx(args, name, shard, cp, a.chunk)
        dist.barrier()
        env.sync()
        t0 = clock.mark()
        out, kl = attn(x, ctx)
        t1 = clock.mark()
        backward(out, kl, g)
        t2 = clock.mark()
        env.sync()
        del out, kl
        if i >= a.warmup:
            fwd.append(clock.ms(t0, t1))
            bwd.append(clock.ms(t1, t2))
            tot.append(clock.ms(t0, t2))
        last_ctx = ctx
        if i == 0 and a.step_budget:  # keep the config inside its budget: fewer repeats (rank 0 decides)
            keep = max(1, min(repeats, int(a.step_budget * 1e3 // max(clock.ms(t0, t2), 1e-3)) - a.warmup))
            t = torch.tensor([keep], device=env.dev)
            dist.broadcast(t, 0)
            repeats = int(t.item())
        i += 1
    row["repeats"] = repeats
    row.update(fwd_ms=median(fwd), bwd_ms=median(bwd), step_ms=median(tot))
    if env.cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    traffic = summarize_traffic(cp.traffic.records)
    row["traffic"] = traffic
    ratio = args.compress_ratios[LAYERS[name][0]]
    shapes = {}
    if shard.left:
        shapes["boundary"] = (shard.left, args.dim, dtype)
    if ratio:
        plan = last_ctx.plan(ratio)
        W = args.head_dim + (args.index_head_dim if LAYERS[name][1] else 0)
        elem = traffic["allgather_fwd_sent"] // max(plan.capacity * W, 1)
        row.update(capacity=plan.capacity, owned=int(plan.start.numel()), width=W, elem_bytes=elem)
        shapes["allgather"] = (plan.capacity, W, {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[elem])
    del last_ctx, x, g, attn
    gc.collect()
    if a.comm_reps:
        row["comm"] = replay_collectives(env, cp, shapes, a.comm_reps)
    return row


def merge_ranks(rows: list[dict], args: ModelArgs, a) -> dict:
    """One row from every rank's row: slowest rank's time, max peak, per-rank bytes, checks."""
    r0 = dict(rows[0])
    cp = r0["cp"]
    for k in ("fwd_ms", "bwd_ms", "step_ms", "peak_gib", "base_gib"):
        vals = [r.get(k) for r in rows if r.get(k) is not None]
        r0[k] = max(vals) if vals else None
        if k == "step_ms":
            r0["step_ms_ranks"] = [r.get(k) for r in rows]
        if k == "peak_gib":
            r0["peak_gib_ranks"] = [r.get(k) for r in rows]
    r0["tok_s_gpu"] = r0["local_rows"] / (r0["step_ms"] / 1e3) if r0.get("step_ms") else None
    r0["traffic_ranks"] = [r["traffic"] for r in rows]
    if "comm" in r0:
        r0["comm"] = {k: max(r["comm"][k] for r in rows) for k in r0["comm"]}
    v = validator_bytes(r0["layer"], args, r0["T"], cp, r0.get("elem_bytes", 2), DTYPES[a.dtype].itemsize)
    r0["validator"] = v
    checks = {}
    t = r0["traffic_ranks"]
    B = v["boundary_width"] * args.dim * DTYPES[a.dtype].itemsize if cp > 1 else 0
    checks["boundary"] = all(tr["boundary_fwd_sent"] == (B if i < cp - 1 else 0) for i, tr in enumerate(t))
    if v["ratio"]:
        owned_total = sum(r["owned"] for r in rows) * r0["width"] * r0["elem_bytes"]
        r0["owned_bytes_total"] = owned_total
        checks["allgather_recv==padded"] = all(tr["allgather_fwd_recv"] == v["padded"] for tr in t)
        checks["allgather_sent==padded/cp"] = all(tr["allgather_fwd_sent"] * cp == v["padded"] for tr in t)
        checks["owned==logical"] = owned_total == v["logical"]
        checks["elem_bytes==2(bf16)"] = r0["elem_bytes"] == 2
    r0["bytes_checks"] = checks
    r0["bytes_ok"] = all(v_ for k, v_ in checks.items() if not k.startswith("elem"))
    for k in ("traffic", "owned", "rank"):
        r0.pop(k, None)
    return r0


def _nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


def run_bench(a) -> None:
    t_start = time.time()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        torch.cuda.set_device(local_rank)
    backend = a.backend
    if backend == "auto":
        backend = "cpu:gloo,cuda:nccl" if a.device == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=a.timeout))
    env = Env(a)
    if not env.cuda:
        torch.set_num_threads(a.threads)
    args = tiny_args() if a.tiny else ModelArgs()
    cp = ContextParallelGroup()
    R0 = env.rank == 0

    def say(*s):
        if R0:
            print(*s, flush=True)

    commit = os.environ.get("V4_COMMIT") or subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(date=a.date or datetime.date.today().isoformat(), commit=commit or "unknown", torch=torch.__version__,
                python=platform.python_version(), backend=backend, world=env.world, cp=cp.size,
                device=torch.cuda.get_device_name() if env.cuda else platform.processor() or "cpu",
                cuda=torch.version.cuda if env.cuda else None,
                nccl=_nccl_version() if env.cuda else None,
                dims="tiny" if a.tiny else "V4-Flash", dtype=a.dtype, chunk=a.chunk, kernels=a.kernels,
                warmup=a.warmup,
                repeats=a.repeats, args=dict(dim=args.dim, n_heads=args.n_heads, head_dim=args.head_dim,
                                             rope_head_dim=args.rope_head_dim, window=args.window_size,
                                             index=f"{args.index_n_heads}x{args.index_head_dim} top-{args.index_topk}",
                                             o_groups=args.o_groups,
                                             boundary_width=boundary_width(args.window_size, args.compress_ratios)))
    say(json.dumps(meta))
    result = dict(meta=meta, probe=None, parity=[], rows=[])

    def save():
        if R0 and a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1, default=str)

    layers = [s for s in a.layers.split(",") if s]
    if env.cuda and a.probe:
        result["probe"] = job_backend_probe(env)
        say("job backend probe (NCCL-only group, as v4launch.training.dist builds it):", json.dumps(result["probe"]))
        save()
    if a.parity_T:
        for dn in [s for s in a.parity_dtypes.split(",") if s]:
            for name in layers:
                try:
                    res = parity(name, args, a.parity_T, dn, env, cp, a.chunk)
                    err = None
                except Exception as e:  # noqa: BLE001
                    res, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                allr = gather_obj(res if err is None else dict(error=err))
                if any("error" in r for r in allr):
                    row = dict(layer=name, dtype=dn, T=a.parity_T, cp=cp.size, ok=False,
                               error=next(r["error"] for r in allr if "error" in r))
                else:
                    row = dict(allr[0], rank=None, min_cos=min(r["min_cos"] for r in allr),
                               topk_rows=sum(r["topk_rows"] for r in allr),
                               truth=max((r["truth"] for r in allr if r.get("truth")),
                                         key=lambda d: d["cpn_rel"], default=None),
                               topk_rows_differing=sum(r["topk_rows_differing"] for r in allr),
                               max_rel=max(r["max_rel"] for r in allr), ok=all(r["ok"] for r in allr),
                               per_rank=[dict(min_cos=r["min_cos"], max_rel=r["max_rel"], worst=r["worst_param"],
                                              checks=r["checks"]) for r in allr])
                result["parity"].append(row)
                say(f"parity {name} {dn} T={a.parity_T} cp={cp.size}: " +
                    (f"min cos {row['min_cos']:.7f}  max rel {row['max_rel']:.2e}  "
                     f"(worst param {row.get('worst_param')}) "
                     + (f"vs float64 truth: worst {row['truth']['tensor']} cp={cp.size} {row['truth']['cpn_rel']:.2e} "
                        f"cp=1 {row['truth']['cp1_rel']:.2e}; " if row.get("truth") else "")
                     + f"top-k rows differing "
                     f"{row['topk_rows_differing']}/{row['topk_rows']} {'PASS' if row['ok'] else 'FAIL'}"
                     if "error" not in row else f"ERROR {row['error']}"))
                save()
                gc.collect()
                if env.cuda:
                    torch.cuda.empty_cache()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    base_oom = {}  # layer -> smallest T at which the CP = 1 baseline ran out of memory
    if a.baseline:
        with open(a.baseline) as f:
            for r in json.load(f)["rows"]:
                if str(r.get("error", "")).startswith("OOM"):
                    base_oom[r["layer"]] = min(base_oom.get(r["layer"], r["T"]), r["T"])
    for name in layers:
        oomed_at = None
        for T in sorted(sizes):
            row = None
            late = a.deadline and time.time() - t_start > a.deadline
            if not agree(env, not late):
                row = dict(layer=name, phase=LAYERS[name][3], T=T, cp=cp.size, skipped="deadline reached")
            elif oomed_at is not None:
                row = dict(layer=name, phase=LAYERS[name][3], T=T, cp=cp.size,
                           skipped=f"OOM at the smaller size {oomed_at}")
            elif name in base_oom and T // cp.size >= base_oom[name]:  # an OOM on one rank would hang the others
                row = dict(layer=name, phase=LAYERS[name][3], T=T, cp=cp.size,
                           skipped=f"predicted OOM: {T // cp.size} rows/rank >= {base_oom[name]}, where CP=1 ran out")
            elif T % cp.size or T // cp.size < boundary_width(args.window_size, args.compress_ratios):
                row = dict(layer=name, phase=LAYERS[name][3], T=T, cp=cp.size,
                           skipped=f"T={T} not divisible by cp or local rows below the boundary width")
            if row is None:
                try:
                    mine = bench_one(name, args, T, env, cp, a)
                except Exception as e:  # noqa: BLE001 - an OOM (or, on one rank, any failure) is a result
                    if env.world > 1 and not is_oom(e):
                        raise  # the other ranks are inside a collective: fail loudly (timeout: --timeout)
                    mine = dict(layer=name, phase=LAYERS[name][3], T=T, cp=cp.size,
                                error=("OOM: " if is_oom(e) else f"{type(e).__name__}: ") + str(e).splitlines()[0][:200])
                    if env.cuda:
                        mine["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
                gc.collect()  # outside the except block: the traceback no longer pins the activations
                if env.cuda:
                    torch.cuda.empty_cache()
                allr = gather_obj(mine)
                errs = [r for r in allr if "error" in r]
                if errs:
                    row = errs[0]
                    if row["error"].startswith("OOM"):
                        oomed_at = T
                else:
                    row = merge_ranks(allr, args, a)
            result["rows"].append(row)
            say(one_line(row))
            save()
            gc.collect()
            if env.cuda:
                torch.cuda.empty_cache()
    say("")
    md = markdown(result)
    say(md)
    save()
    if R0 and a.md:
        Path(a.md).write_text(md + "\n")
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- output
def fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def one_line(r: dict) -> str:
    if "skipped" in r or "error" in r:
        return f"{r['layer']} T={r['T']} cp={r['cp']}: {r.get('skipped') or r.get('error')}"
    return (f"{r['layer']} T={r['T']} cp={r['cp']}: fwd {r['fwd_ms']:.1f} ms bwd {r['bwd_ms']:.1f} ms "
            f"step {r['step_ms']:.1f} ms, {r['tok_s_gpu']:.0f} tok/s/GPU, peak {fmt(r.get('peak_gib'), 2)} GiB, "
            f"bytes {'OK' if r['bytes_ok'] else 'MISMATCH'} {r['bytes_checks']}")


def markdown(result: dict) -> str:
    m = result["meta"]
    out = [f"CP = {m['cp']} ({m['world']} rank(s), {m['backend']}), {m['device']}, torch {m['torch']}, "
           f"{m['dims']} dims, {m['dtype']}, commit {m['commit']}", ""]
    if result.get("probe"):
        out += ["Job process-group probe (NCCL-only group): " +
                "; ".join(f"{k}: {v}" for k, v in result["probe"].items()), ""]
    if result["parity"]:
        out += ["| parity: layer | dtype | T | cp | min cosine | max rel L2 | worst param grad | "
                "top-k rows differing from CP = 1 | vs float64 truth: tensor, CP = N / CP = 1 rel L2 | gate | result |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in result["parity"]:
            gate = f"cos >= 1-{BF16_COS:g}" if p["dtype"] == "bf16" else f"rel <= {FP32_REL:g}"
            if "error" in p:
                out.append(f"| {p['layer']} | {p['dtype']} | {p['T']} | {p['cp']} | - | - | - | - | - | {gate} | "
                           f"ERROR {p['error']} |")
            else:
                out.append(f"| {p['layer']} | {p['dtype']} | {p['T']} | {p['cp']} | {p['min_cos']:.7f} | "
                           f"{p['max_rel']:.2e} | {p['worst_param']} | "
                           f"{p.get('topk_rows_differing', '-')} of {p.get('topk_rows', '-')} | "
                           + (f"{p['truth']['tensor']}: {p['truth']['cpn_rel']:.2e} / {p['truth']['cp1_rel']:.2e}"
                              if p.get("truth") else "-") + f" | {gate} | "
                           f"{'PASS' if p['ok'] else 'FAIL'} |")
        out.append("")
    out += ["| layer | T | cp | rows/rank | fwd ms | bwd ms | fwd+bwd ms | tok/s/GPU | peak GiB/rank | "
            "boundary B/layer fwd (runtime / validator) | all-gather B/layer recv (runtime / validator padded) | "
            "owned B (runtime / validator logical) | all-gather bwd B | boundary ms fwd / bwd | "
            "all-gather ms fwd / bwd | bytes |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "skipped" in r or "error" in r:
            out.append(f"| {r['layer']} | {r['T']} | {r['cp']} | {r['T'] // r['cp']} | "
                       f"{r.get('skipped') or r.get('error')} | | | | {fmt(r.get('peak_gib'), 1) if 'error' in r else ''} "
                       "| | | | | | | |")
            continue
        v, t0, c = r["validator"], r["traffic_ranks"][0], r.get("comm", {})
        bmax = max(tr["boundary_fwd_sent"] for tr in r["traffic_ranks"])
        ag = (f"{t0['allgather_fwd_recv']:,} / {v['padded']:,}" if v["ratio"] else "-")
        own = (f"{r['owned_bytes_total']:,} / {v['logical']:,}" if v["ratio"] else "-")
        out.append(
            f"| {r['layer']} | {r['T']} | {r['cp']} | {r['local_rows']} | {fmt(r['fwd_ms'])} | {fmt(r['bwd_ms'])} | "
            f"{fmt(r['step_ms'])} | {fmt(r['tok_s_gpu'], 0)} | {fmt(r.get('peak_gib'), 2)} | "
            f"{bmax:,} / {v['boundary']:,} | {ag} | {own} | {t0['allgather_bwd']:,} | "
            f"{fmt(c.get('boundary_fwd_ms'), 3)} / {fmt(c.get('boundary_bwd_ms'), 3)} | "
            f"{fmt(c.get('allgather_fwd_ms'), 3)} / {fmt(c.get('allgather_bwd_ms'), 3)} | "
            f"{'OK' if r['bytes_ok'] else 'MISMATCH'}{'' if r.get('elem_bytes', 2) == 2 else ' (%d B/elem)' % r['elem_bytes']} |")
    return "\n".join(out)


def compare_runs(paths: list[str]) -> int:
    """Memory gates and scaling from several json files (one per CP size). Returns 1 when a gate fails."""
    runs = {}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        runs[r["meta"]["cp"]] = r
    if 1 not in runs:
        print("no CP = 1 run among the files: the gates need it")
        return 2
    base = {(r["layer"], r["T"]): r for r in runs[1]["rows"]}
    lines = ["| layer | T | cp | fwd+bwd ms | tok/s/GPU | scaling vs CP=1 (per GPU) | peak GiB/rank | CP=1 peak GiB | "
             "peak ratio | gate | result |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    failed, evaluated = False, 0
    for cpn in sorted(k for k in runs if k != 1):
        for r in runs[cpn]["rows"]:
            b = base.get((r["layer"], r["T"]))
            gate = GATES.get(cpn)
            gtxt = f"< {gate:g}x" if gate else "no gate"
            peak, bpk = r.get("peak_gib"), (b or {}).get("peak_gib") if b and "error" not in b and "skipped" not in b else None
            if "error" in r or "skipped" in r:
                verdict = "FAIL (CP run: " + (r.get("error") or r.get("skipped"))[:60] + ")" if gate else "-"
                failed |= bool(gate) and "error" in r
                lines.append(f"| {r['layer']} | {r['T']} | {cpn} | - | - | - | - | {fmt(bpk, 2)} | - | {gtxt} | {verdict} |")
                continue
            if b is None or bpk is None:
                why = "no CP=1 row" if b is None else (b.get("error") or b.get("skipped") or "no peak")[:50]
                verdict = f"n/a (CP=1: {why})"
                ratio = None
            else:
                ratio = peak / bpk if peak is not None else None
                if gate and ratio is not None:
                    ok = ratio < gate
                    failed |= not ok
                    evaluated += 1
                    verdict = "PASS" if ok else "FAIL"
                else:
                    verdict = "-"
            scale = (r["tok_s_gpu"] / b["tok_s_gpu"]) if b and b.get("tok_s_gpu") else None
            lines.append(f"| {r['layer']} | {r['T']} | {cpn} | {fmt(r['step_ms'])} | {fmt(r['tok_s_gpu'], 0)} | "
                         f"{fmt(scale, 2)} | {fmt(peak, 2)} | {fmt(bpk, 2)} | {fmt(ratio, 3)} | {gtxt} | {verdict} |")
    par = []
    for cpn, r in sorted(runs.items()):
        for p in r["parity"]:
            par.append(f"cp={cpn} {p['layer']} {p['dtype']} T={p['T']}: {'PASS' if p.get('ok') else 'FAIL'}")
            failed |= not p.get("ok")
    print("\n".join(lines))
    print("\nparity: " + ("; ".join(par) if par else "none run"))
    print(f"\nmemory gates evaluated: {evaluated};", "FAIL" if failed else ("PASS" if evaluated else "none evaluated"))
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="read runs (one per CP size) and check the gates")
    ap.add_argument("--layers", default="SWA,CSA,HCA")
    ap.add_argument("--sizes", default="65536,131072", help="tokens per packed batch (one segment), comma separated")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (CPU smoke test); default V4-Flash dims")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--backend", default="auto", help="process group backend; auto = cpu:gloo,cuda:nccl on GPUs")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--chunk", type=int, default=256, help="query rows per chunk of the reference attention")
    ap.add_argument("--kernels", default="reference", choices=["reference", "triton"],
                    help="attention kernels of the CP = world runs (parity compares them with the CP = 1 reference)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-budget", type=float, default=0.0,
                    help="seconds per config: fewer repeats when warm-up x steps would exceed it (0 = off)")
    ap.add_argument("--comm-reps", type=int, default=10, help="timed replays per collective (0 = off)")
    ap.add_argument("--parity-T", type=int, default=4096, help="tokens of the parity batch (0 = no parity)")
    ap.add_argument("--parity-dtypes", default="bf16,fp32")
    ap.add_argument("--no-probe", dest="probe", action="store_false", help="skip the NCCL-only group probe")
    ap.add_argument("--deadline", type=float, default=0.0, help="skip configs started after N s (0 = none)")
    ap.add_argument("--timeout", type=float, default=180.0,
                    help="process-group timeout, seconds (a rank that ran out of memory leaves the others waiting)")
    ap.add_argument("--baseline", default="", help="a CP = 1 json: skip configs whose rows per rank ran out of "
                    "memory there (per-rank memory at CP = n and T ~ CP = 1 at T / n)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank (CPU runs)")
    ap.add_argument("--date", default="", help="date for the record (default today)")
    ap.add_argument("--out", default="", help="write the json here (rank 0)")
    ap.add_argument("--md", default="", help="also write the markdown tables here (rank 0)")
    a = ap.parse_args(argv)
    if a.compare:
        return compare_runs(a.compare)
    KERNELS["name"] = a.kernels
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" not in os.environ:  # plain `python cp_scaling.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    run_bench(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
