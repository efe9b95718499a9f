"""The routed experts' FP8 MLP (model/fp8_experts.py) on the CPU, where its grouped GEMMs run emulated (the e4m3
operands times their scales in float32): the casts against e4m3 arithmetic written here, the SwiGLU backward
against float64 autograd, the whole MLP against per-expert float64 matmuls, and its gradient topology.
The SM90 kernels themselves: tests/model/test_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch

from v4launch.model.fp8_experts import fp8_expert_mlp, rowwise_e4m3, swiglu_e4m3, swiglu_grad_e4m3
from v4launch.model.moe import Expert, run_local_experts


def _e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, k] float64 -> its rowwise e4m3 rounding, dequantised, float64 (scale 2^floor(log2(448 / amax)))."""
    out = torch.zeros_like(x)
    for i, row in enumerate(x):
        amax = float(row.abs().max())
        if amax == 0:
            continue
        scale = 2.0 ** math.floor(math.log2(448.0 / amax))
        out[i] = (row * scale).to(torch.float8_e4m3fn).double() / scale
    return out


def _swiglu64(g13: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = g13.chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate) * up


def test_rowwise_e4m3_has_power_of_two_scales_and_e4m3_rounding(gen):
    x = torch.randn(12, 64, generator=gen) * torch.logspace(-4, 4, 12).unsqueeze(1)
    x[5] = 0  # a padding row
    q, scale = rowwise_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (12,) and scale.dtype == torch.float32
    exps = torch.log2(scale)
    assert torch.equal(exps, exps.round()) and bool(torch.isfinite(scale).all())  # powers of two, finite
    peak = q.float().abs().amax(1)
    # each row's amax lands in [224, 448] (e4m3 rounds (224, 232) down to 224)
    assert bool(((peak >= 224) & (peak <= 448))[torch.arange(12) != 5].all())
    assert not bool(q[5].float().any())
    assert torch.equal((q.double() * scale.double()[:, None]), _e4m3_rows(x.double()))


@pytest.mark.parametrize("limit", [0.0, 1.25])
def test_swiglu_regions_match_float64_autograd(limit, gen):
    g13 = (torch.randn(40, 64, generator=gen) * 2).requires_grad_()
    dh = torch.randn(40, 32, generator=gen)
    ref_g = g13.detach().double().requires_grad_()
    h_ref = _swiglu64(ref_g, limit)
    (h_ref * dh.double()).sum().backward()
    hq, hs = swiglu_e4m3(g13.detach(), limit)
    assert torch.equal(hq.double() * hs.double()[:, None], _e4m3_rows(h_ref.detach().float().double()))
    dq, ds, dg13, h = swiglu_grad_e4m3(g13.detach(), dh, limit)
    assert torch.allclose(h.double(), h_ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(dg13.double(), ref_g.grad, rtol=1e-5, atol=1e-6)
    if limit:
        assert bool((dg13[:, :32][g13.detach()[:, :32] > limit] == 0).all())  # clamped gate: no gradient
    assert torch.equal(dq.double() * ds.double()[:, None], _e4m3_rows(dg13.double()))


def _mlp_case(gen, n_experts=4, dim=32, inter=16, limit=1.5):
    counts = torch.randint(1, 40, (n_experts,), generator=gen)
    counts[1] = 0
    experts = [Expert(dim, inter, swiglu_limit=limit) for _ in range(n_experts)]
    for e in experts:
        for lin in (e.w1, e.w2, e.w3):
            lin.weight.data = torch.randn(lin.weight.shape, generator=gen) / lin.in_features ** 0.5
    x = torch.randn(int(counts.sum()), dim, generator=gen)
    dy = torch.randn(int(counts.sum()), dim, generator=gen)
    return experts, counts, x, dy


def _float64_reference(experts, counts, x, dy):
    start, ys, dxs, dws = 0, [], [], []
    for expert, n in zip(experts, counts.tolist()):
        w = [getattr(expert, k).weight.detach().double().requires_grad_() for k in ("w1", "w3", "w2")]
        xr = x[start:start + n].double().requires_grad_()
        y = _swiglu64(torch.cat([xr @ w[0].T, xr @ w[1].T], dim=1), expert.limit) @ w[2].T
        (y * dy[start:start + n].double()).sum().backward()
        ys.append(y.detach())
        dxs.append(xr.grad)
        dws.append([wi.grad for wi in w])
        start += n
    return torch.cat(ys), torch.cat(dxs), dws


def _rel(a, b):
    return float((a.detach().double() - b).norm() / b.norm())


def test_fp8_routed_experts_track_float64_and_an_empty_expert_gets_zero_gradients(gen):
    """``run_local_experts(fp8=True)`` (emulated GEMMs): FP8's error against float64, but not float32's (so the
    casts ran); an expert with no rows gets weight gradients that are exactly zero. No clamp here: an entry near
    the SwiGLU limit may land on the other side of it after e4m3 rounding, and its gradient then flips between
    zero and whole (the clamp's gradient: test_swiglu_regions_match_float64_autograd)."""
    experts, counts, x, dy = _mlp_case(gen, limit=0.0)
    ref_y, ref_dx, ref_dw = _float64_reference(experts, counts, x, dy)
    x = x.requires_grad_()
    y = run_local_experts(experts, x, counts, grouped=True, fp8=True)
    (y * dy).sum().backward()
    assert y.shape == x.shape and 1e-3 < _rel(y, ref_y) <= 0.1, _rel(y, ref_y)  # e4m3's error (40 seeds: 0.05-0.08)
    assert _rel(x.grad, ref_dx) <= 0.12, _rel(x.grad, ref_dx)
    for e, (expert, n) in enumerate(zip(experts, counts.tolist())):
        for k, want in zip(("w1", "w3", "w2"), ref_dw[e]):
            g = getattr(expert, k).weight.grad
            assert g is not None and bool((g == 0).all()) == (n == 0), (e, k)
            if n:
                assert _rel(g, want) <= 0.2, (e, k, _rel(g, want))  # groups of a few rows: up to 0.13 seen


def test_fp8_mlp_is_the_e4m3_products_forward_and_backward(gen):
    """Every output and gradient of :class:`Fp8ExpertMLP` equals the chain written here in float64 from the casts'
    definition: rowwise e4m3 of each e4m3 GEMM's left operand and of each output column of the weights, the
    weight gradients as plain products. An expert with no rows gets zero weight gradients."""
    limit = 1.5
    experts, counts, x, dy = _mlp_case(gen, limit=limit)
    w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts]).detach().requires_grad_()
    w2 = torch.stack([e.w2.weight for e in experts]).detach().requires_grad_()
    x = x.requires_grad_()
    y = fp8_expert_mlp(x, w13, w2, counts, limit)
    (y * dy).sum().backward()
    q = _e4m3_rows
    ends = torch.cumsum(counts, 0).tolist()
    for e, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
        if hi == lo:
            assert not bool(w13.grad[e].any()) and not bool(w2.grad[e].any())
            continue
        xe, dye = x.detach()[lo:hi].double(), dy[lo:hi].double()
        w13e, w2e = w13.detach()[e].double(), w2.detach()[e].double()
        g13 = (q(xe) @ q(w13e).T).float().double().requires_grad_()  # the GEMM's output in x's dtype
        h = _swiglu64(g13, limit)
        want_y = q(h.detach()) @ q(w2e).T
        dh = (q(dye) @ q(w2e.T).T).float().double()
        h.backward(dh)
        dg13 = g13.grad.float().double()
        for got, want in ((y.detach()[lo:hi], want_y), (x.grad[lo:hi], q(dg13) @ q(w13e.T).T),
                          (w2.grad[e], dye.T @ h.detach()), (w13.grad[e], dg13.T @ xe)):
            assert _rel(got, want) <= 2e-3, (e, _rel(got, want))


def test_fp8_mlp_refuses_widths_its_kernels_cannot_run():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_expert_mlp(torch.zeros(16, 24), torch.zeros(1, 32, 24), torch.zeros(1, 24, 16), torch.tensor([16]), 0.0)
