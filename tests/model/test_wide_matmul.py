"""bf16 GEMMs with float32 results (model/matmul.py): values, gradients, dtypes, full-precision paths unchanged.

References are float64 products of the same (bf16-rounded) operands, written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from v4launch.model import matmul
from v4launch.model.common import linear
from v4launch.model.mhc import hc_pre


def _rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_bf16_input_gives_float32_product_of_bf16_operands_and_gradients(gen, w_dtype):
    x = _rand(gen, 3, 5, 64, dtype=torch.bfloat16).requires_grad_()
    w = _rand(gen, 12, 64, dtype=w_dtype).requires_grad_()
    y = matmul.project(x, w, torch.float32)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 12)
    xr, wr = x.detach().double(), w.detach().to(torch.bfloat16).double()  # what the GEMM sees
    # float32 accumulation of 64 exact bf16 x bf16 products: |error| <= K * 2^-24 * sum_k |x_k w_k| (K = 64)
    bound = 64 * 2.0 ** -24 * (xr.abs() @ wr.abs().t())
    assert ((y.double() - xr @ wr.t()).abs() <= bound).all()
    g = _rand(gen, 3, 5, 12)
    y.backward(g)
    gr = g.to(torch.bfloat16).double()  # the backward GEMMs read the gradient in bf16 too
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == w_dtype
    torch.testing.assert_close(x.grad.double(), gr @ wr, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    want = gr.flatten(0, 1).t() @ xr.flatten(0, 1)
    if w_dtype == torch.float32:  # 15 exact bf16 products accumulated in float32, as above
        assert ((w.grad.double() - want).abs() <= 15 * 2.0 ** -24 * (gr.abs().flatten(0, 1).t() @ xr.abs().flatten(0, 1))).all()
    else:
        torch.testing.assert_close(w.grad.double(), want, rtol=1e-2, atol=1e-2)  # bf16 output rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_inputs_are_the_plain_product_bit_for_bit(gen, dtype):
    layer = torch.nn.Linear(16, 7, bias=False).to(dtype)
    x = _rand(gen, 9, 16, dtype=dtype).requires_grad_()
    y = linear(x, layer, dtype)
    x2 = x.detach().clone().requires_grad_()
    ref = F.linear(x2, layer.weight)
    assert torch.equal(y, ref)
    g = _rand(gen, 9, 7, dtype=dtype)
    (dx,) = torch.autograd.grad(y, x, g)
    (dx2,) = torch.autograd.grad(ref, x2, g)
    assert torch.equal(dx, dx2)


def test_under_autocast_a_float32_request_stays_float32_on_bf16_operands(gen):
    x, w = _rand(gen, 6, 32), _rand(gen, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wide = matmul.project(x, w, torch.float32)
        plain = matmul.project(x, w)  # no dtype: autocast decides, as for any linear
    assert wide.dtype == torch.float32 and plain.dtype == torch.bfloat16
    ref = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()
    torch.testing.assert_close(wide.double(), ref, rtol=1e-6, atol=1e-6)


def test_mhc_mixing_of_bf16_streams_uses_the_wide_gemm(gen, monkeypatch):
    calls = []
    real = matmul.mm_wide

    def spy(a, b, out_dtype):
        calls.append((a.dtype, b.dtype, out_dtype))
        return real(a, b, out_dtype)

    monkeypatch.setattr(matmul, "mm_wide", spy)
    T, hc, dim = 5, 2, 8
    x = _rand(gen, T, hc, dim, dtype=torch.bfloat16)
    fn, base, scale = _rand(gen, (2 + hc) * hc, hc * dim), _rand(gen, (2 + hc) * hc), 1 + 0.1 * _rand(gen, 3)
    y, post, comb = hc_pre(x, fn, scale, base, 5, 1e-6, 1e-6)
    assert calls == [(torch.bfloat16, torch.bfloat16, torch.float32)]
    assert y.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    # against float64 mixing of the same streams with the bf16-rounded fn
    y64, post64, comb64 = hc_pre(x.double(), fn.to(torch.bfloat16).double(), scale.double(), base.double(), 5,
                                 1e-6, 1e-6)
    torch.testing.assert_close(post.double(), post64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb.double(), comb64, rtol=1e-5, atol=1e-5)


def test_switching_wide_gemms_off_restores_the_float32_product(gen):
    x, w = _rand(gen, 4, 16, dtype=torch.bfloat16), _rand(gen, 3, 16)
    matmul.set_wide_gemm(False)
    try:
        y = matmul.project(x, w, torch.float32)
    finally:
        matmul.set_wide_gemm(True)
    assert torch.equal(y, F.linear(x.float(), w))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("acc_dtype,op_dtype,tol", [(torch.float32, torch.bfloat16, 1e-5),
                                                    (torch.bfloat16, torch.bfloat16, 1e-2),
                                                    (torch.float64, torch.float64, 1e-12)])
def test_addmm_wide_accumulates_in_place(gen, device, acc_dtype, op_dtype, tol):
    """acc += a @ b into the same storage, against the float64 sum of the (rounded) operands' product;
    three accumulations, as the head's weight gradient over three chunks."""
    acc = _rand(gen, 6, 5, dtype=acc_dtype).to(device)
    want = acc.double().clone()  # a float64 acc.double() is acc itself
    storage = acc.data_ptr()
    for _ in range(3):
        a, b = _rand(gen, 6, 32, dtype=op_dtype).to(device), _rand(gen, 32, 5, dtype=op_dtype).to(device)
        assert matmul.addmm_wide_(acc, a, b) is acc
        want = want + a.double() @ b.double()
    assert acc.data_ptr() == storage and acc.dtype == acc_dtype
    torch.testing.assert_close(acc.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
