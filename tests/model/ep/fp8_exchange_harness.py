"""Harness of test_ep_fp8_exchange.py: on each gloo rank, ``ExpertParallelDispatch.fp8_experts`` (e4m3 rows on
the all-to-all) against the one-process FP8 MLP (``fp8_experts.Fp8ExpertMLP`` over every expert) on this rank's
rows, given inputs and output gradients already rounded to their rowwise e4m3 values (a rowwise cast of such a
row gives the same values back, so the reference's casts, GEMMs and weight-gradient operands are what the
exchange's are). The CPU runs the e4m3 GEMMs emulated, in float32. A uniquely named module."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/model (v4_helpers)

from v4_helpers import gloo_spawn  # noqa: E402

from v4launch.model import fp8_experts  # noqa: E402
from v4launch.model.parallel import ExpertParallelDispatch  # noqa: E402


def spawn(world: int, cases: list[dict], tmp_path) -> list[list[dict]]:
    return gloo_spawn(world, cases, tmp_path, fp8_exchange_case)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


def _e4m3_values(t: torch.Tensor) -> torch.Tensor:
    q, s = fp8_experts.rowwise_e4m3(t)
    return q.float() * s[:, None]


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _float64_weight_grads(x, dy, w13, w2, counts, limit):
    """d(sum y·dy)/d(w13, w2) in float64 for this rank's rows (expert by expert, plain matmuls, the clamped SwiGLU
    written out), summed over the ranks."""
    w13d = w13.double().requires_grad_()
    w2d = w2.double().requires_grad_()
    ys, start = [], 0
    for e, n in enumerate(counts.tolist()):
        g13 = x[start:start + n].double() @ w13d[e].T
        gate, up = g13.chunk(2, dim=-1)
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        ys.append((gate * torch.sigmoid(gate) * up) @ w2d[e].T)
        start += n
    (torch.cat(ys) * dy.double()).sum().backward()
    dist.all_reduce(w13d.grad)
    dist.all_reduce(w2d.grad)
    return w13d.grad, w2d.grad


def fp8_exchange_case(case: dict) -> dict:
    """case: seed, n_experts, dim, inter, rows (per rank), empty_rank (a rank whose experts get no rows, or -1),
    limit, raw (optional: x and dy not pre-rounded; the weight gradients of both paths against float64). Returns the relative gaps of y, dx, dw13, dw2 and what crossed the wire (dtype, row width)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    E, dim, inter = case["n_experts"], case["dim"], case["inter"]
    n_local = E // world
    gen = torch.Generator().manual_seed(case["seed"])  # the same weights on every rank
    w13 = torch.randn(E, 2 * inter, dim, generator=gen) / dim ** 0.5
    w2 = torch.randn(E, dim, inter, generator=gen) / inter ** 0.5
    mine = torch.Generator().manual_seed(case["seed"] * 1000 + rank + 1)  # this rank's own rows
    rows = case["rows"][rank]
    allowed = [e for e in range(E) if e // n_local != case["empty_rank"]]
    experts = torch.tensor(allowed)[torch.randint(len(allowed), (rows,), generator=mine)]
    counts = torch.bincount(experts, minlength=E)
    x = torch.randn(rows, dim, generator=mine) * torch.rand(rows, 1, generator=mine) * 4
    dy = torch.randn(rows, dim, generator=mine)
    raw = case.get("raw", False)  # x and dy as drawn: the exchange's weight gradients then see their e4m3 values
    if not raw:
        x, dy = _e4m3_values(x), _e4m3_values(dy)

    # the exchange: this rank's experts only
    dispatcher = ExpertParallelDispatch(dist.group.WORLD, world, rank, E)
    lo = rank * n_local
    w13_l = w13[lo:lo + n_local].clone().requires_grad_()
    w2_l = w2[lo:lo + n_local].clone().requires_grad_()
    xe = x.clone().requires_grad_()
    wire = []
    send = dist.all_to_all_single

    def recording(out, inp, *a, **k):
        wire.append((str(inp.dtype).removeprefix("torch."), list(inp.shape)))
        return send(out, inp, *a, **k)

    dist.all_to_all_single = recording
    try:
        y = dispatcher.fp8_experts(xe, counts, w13_l, w2_l, case["limit"])
        y.backward(dy)
    finally:
        dist.all_to_all_single = send

    # the reference: every expert in this process, this rank's rows; weight gradients summed over the ranks
    xr, w13r, w2r = x.clone().requires_grad_(), w13.clone().requires_grad_(), w2.clone().requires_grad_()
    if rows:
        yr = fp8_experts.fp8_expert_mlp(xr, w13r, w2r, counts, case["limit"])
        yr.backward(dy)
    else:  # no rows here (the grouped GEMM's weight gradient refuses zero rows): nothing, and zero gradients
        yr, xr.grad, w13r.grad, w2r.grad = x.clone(), torch.zeros_like(x), torch.zeros_like(w13), torch.zeros_like(w2)
    dist.all_reduce(w13r.grad)
    dist.all_reduce(w2r.grad)
    if raw:  # each path's weight gradients against float64 (plain matmuls, every expert, summed over the ranks)
        d13, d2 = _float64_weight_grads(x, dy, w13, w2, counts, case["limit"])
        mine_l = slice(lo, lo + n_local)
        return {"exchange_dw13": _rel_l2(w13_l.grad, d13[mine_l]), "exchange_dw2": _rel_l2(w2_l.grad, d2[mine_l]),
                "local_dw13": _rel_l2(w13r.grad[mine_l], d13[mine_l]), "local_dw2": _rel_l2(w2r.grad[mine_l], d2[mine_l]),
                "y": _rel(y.detach(), yr.detach()), "dx": _rel(xe.grad, xr.grad)}
    return {"y": _rel(y.detach(), yr.detach()), "dx": _rel(xe.grad, xr.grad),
            "dw13": _rel(w13_l.grad, w13r.grad[lo:lo + n_local]), "dw2": _rel(w2_l.grad, w2r.grad[lo:lo + n_local]),
            "dw_zero": bool(w13_l.grad.abs().sum() == 0 and w2_l.grad.abs().sum() == 0),
            "rows_back": int(y.shape[0]), "wire": wire}
