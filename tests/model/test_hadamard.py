"""Hadamard rotation of the indexer (model.compressor.hadamard_rotate): cached matrices, the float32 /
float64 product unchanged bit for bit, and bf16 as a tensor-core GEMM against the exact +-1 signs
(issue 17: it was a float32 GEMM of upcast operands on the CUDA cores)."""

from __future__ import annotations

import torch

from v4launch.model.compressor import hadamard_matrix, hadamard_rotate


def _truth(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return x.double() @ (h * n ** -0.5)


def test_matrix_is_built_once_and_matches_the_sylvester_construction():
    a = hadamard_matrix(32, torch.float32, torch.device("cpu"))
    assert a is hadamard_matrix(32, torch.float32, "cpu")
    assert torch.equal(a.double(), _truth(torch.eye(32, dtype=torch.float64)).float().double())
    signs = hadamard_matrix(32, torch.bfloat16, "cpu", normalised=False)
    assert torch.equal(signs.double().abs(), torch.ones(32, 32, dtype=torch.float64))
    assert torch.equal(signs.double() * 32 ** -0.5, _truth(torch.eye(32, dtype=torch.float64)))


def test_float32_and_float64_are_the_plain_product_bit_for_bit(gen):
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(5, 3, 64, generator=gen, dtype=torch.float64).to(dtype)
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < 64:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        assert torch.equal(hadamard_rotate(x), x @ (h * 64 ** -0.5).to(dtype))


def test_bf16_is_one_rounding_of_the_exact_rotation_with_gradients(gen):
    x64 = torch.randn(40, 128, generator=gen, dtype=torch.float64)
    x = x64.to(torch.bfloat16).requires_grad_()
    y = hadamard_rotate(x)
    assert y.dtype == torch.bfloat16
    truth = _truth(x.detach())
    # one bf16 rounding of (nearly) exact values: within half an ulp plus float32 accumulation noise
    assert ((y.double() - truth).abs() <= truth.abs() * 2.0 ** -8 + 1e-6).all()
    old = (x.detach().float() @ hadamard_matrix(128, torch.float32, "cpu")).to(torch.bfloat16)  # the former path
    assert (y.double() - truth).norm() <= (old.double() - truth).norm() * 1.01
    g = torch.randn(40, 128, generator=gen, dtype=torch.float64)
    (y.double() * g).sum().backward()
    assert torch.allclose(x.grad.double(), _truth(g), rtol=2.0 ** -7, atol=1e-2)  # H symmetric: dx = g @ H
