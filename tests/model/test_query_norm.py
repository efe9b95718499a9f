"""The per-head query norm (``common.rms_unweighted``): float64 math, its gradient, chunking, and
what it keeps for backward (a 128K-token CSA layer ran out of memory on float32 copies of q)."""

from __future__ import annotations

import pytest
import torch

from v4launch.model import common


def plain_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) per last-dim vector, in float64."""
    x = x.double()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_matches_float64_value_and_gradient(dtype, tol):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x64 = torch.randn(37, 5, 96, generator=gen, dtype=torch.float64) * 4
    g64 = torch.randn(37, 5, 96, generator=gen, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    y = common.rms_unweighted(x, 1e-6)
    (gx,) = torch.autograd.grad(y, x, g64.to(dtype))
    xr = x.detach().double().requires_grad_()  # the rounded input, so only the math is compared
    (gr,) = torch.autograd.grad(plain_rms(xr, 1e-6), xr, g64.to(dtype).double())
    assert y.dtype == gx.dtype == dtype
    assert ((y.double() - plain_rms(xr, 1e-6)).norm() / plain_rms(xr, 1e-6).norm()) < tol
    assert ((gx.double() - gr).norm() / gr.norm()) < tol


def test_gradcheck_in_float64():
    x = torch.randn(6, 3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: common.rms_unweighted(t, 1e-6), (x,))


def test_chunks_change_nothing(monkeypatch):
    x = torch.randn(29, 4, 64, dtype=torch.float32, requires_grad=True)
    g = torch.randn_like(x)
    y1 = common.rms_unweighted(x, 1e-6)
    (g1,) = torch.autograd.grad(y1, x, g)
    monkeypatch.setattr(common, "RMS_CHUNK_ROWS", 7)  # 116 vectors in 17 chunks, the last partial
    y2 = common.rms_unweighted(x, 1e-6)
    (g2,) = torch.autograd.grad(y2, x, g)
    assert torch.equal(y1, y2) and torch.equal(g1, g2)


def test_keeps_the_input_and_one_scalar_per_vector_for_backward():
    T, H, D = 64, 8, 128
    x = torch.randn(T, H, D, dtype=torch.bfloat16).requires_grad_()
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = common.rms_unweighted(x, 1e-6)
    assert sum(saved.values()) == x.numel() * 2 + T * H * 4  # bf16 x and a float32 r per vector
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
