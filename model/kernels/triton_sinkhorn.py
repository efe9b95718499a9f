"""Triton kernels: the mHC Sinkhorn normalisation (``mhc.sinkhorn``) in one launch per direction.

Each token's [hc, hc] logits (hc = 4 in V4) are normalised in registers: row softmax ``+ eps``, a
column normalisation, then ``iters - 1`` rounds of row then column normalisation, every denominator
``sum + eps`` (spec §4 item 5; the released ``hc_split_sinkhorn`` kernel). Written as PyTorch
operations the ``iters = 20`` rounds are ~80 tiny kernels forward and, through autograd, ~150
backward per mHC mixing; ``torch.compile`` cannot fuse a chain of dependent reductions into one
kernel, so a compiled benchmark step launched ~2,600 of them (benchmarks/results/train_step_h200.md)
and the host, not the GPU, set the step time.

Backward (per token, no saved intermediates): a normalisation ``y = x / d`` with ``d = sum_axis x +
eps`` has ``dx = (dy - sum_axis(dy * y)) / d``, and the softmax ``s`` has ``dl = s * (ds - sum_k(ds *
s))``. The state before round ``r`` is recomputed from the logits for each round, walking the rounds
backwards: O(iters^2) normalisations of 16 numbers per token (a few microseconds at the benchmark's
8,192 tokens) instead of O(iters) states saved per token. No atomics: every run gives the same bits.

Exposed as ``torch.library.triton_op`` (:func:`sinkhorn`, with its autograd formula registered), so a
``torch.compile``d region traces the call without a graph break and inductor launches the kernels
itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

BLOCK_TOKENS = 32
"""Tokens per program: 32 x hc x hc float32 values, 16 per thread of one warp at hc = 4."""


@triton.jit
def _softmax_eps(x, EPS: tl.constexpr):
    """Row softmax (over the last axis, k) of [B, HC, HC] values; returns (softmax, softmax + EPS)."""
    e = tl.exp(x - tl.max(x, axis=2)[:, :, None])
    s = e / tl.sum(e, axis=2)[:, :, None]
    return s, s + EPS


@triton.jit
def _col_norm(x, EPS: tl.constexpr):
    """x / (column sum + EPS): the sum runs over sources j (axis 1). Returns (y, 1 / denominator)."""
    inv = 1.0 / (tl.sum(x, axis=1)[:, None, :] + EPS)
    return x * inv, inv


@triton.jit
def _row_norm(x, EPS: tl.constexpr):
    """x / (row sum + EPS): the sum runs over targets k (axis 2). Returns (y, 1 / denominator)."""
    inv = 1.0 / (tl.sum(x, axis=2)[:, :, None] + EPS)
    return x * inv, inv


@triton.jit
def _tile(N, BLOCK: tl.constexpr, HC: tl.constexpr):
    """Offsets [BLOCK, HC, HC] of this program's tokens in a contiguous [N, HC, HC] tensor, and the mask."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, HC)
    offs = n.to(tl.int64)[:, None, None] * (HC * HC) + j[None, :, None] * HC + j[None, None, :]
    return offs, offs < N * (HC * HC)


@triton.jit
def _sinkhorn_fwd_kernel(L, OUT, N, iters, EPS: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask = _tile(N, BLOCK, HC)
    s, x = _softmax_eps(tl.load(L + offs, mask=mask, other=0.0), EPS)
    x, inv = _col_norm(x, EPS)
    for _round in range(iters - 1):
        x, inv = _row_norm(x, EPS)
        x, inv = _col_norm(x, EPS)
    tl.store(OUT + offs, x, mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(L, DOUT, DL, N, iters, EPS: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask = _tile(N, BLOCK, HC)
    s, a0 = _softmax_eps(tl.load(L + offs, mask=mask, other=0.0), EPS)
    g = tl.load(DOUT + offs, mask=mask, other=0.0)
    for i in range(iters - 1):  # rounds iters-2 .. 0, each (row, col), backwards
        x, inv = _col_norm(a0, EPS)
        for _round in range(iters - 2 - i):
            x, inv = _row_norm(x, EPS)
            x, inv = _col_norm(x, EPS)
        y_row, inv_row = _row_norm(x, EPS)
        y_col, inv_col = _col_norm(y_row, EPS)
        g = (g - tl.sum(g * y_col, axis=1)[:, None, :]) * inv_col
        g = (g - tl.sum(g * y_row, axis=2)[:, :, None]) * inv_row
    y1, inv1 = _col_norm(a0, EPS)  # the first column normalisation, on softmax + eps
    g = (g - tl.sum(g * y1, axis=1)[:, None, :]) * inv1
    dl = s * (g - tl.sum(g * s, axis=2)[:, :, None])
    tl.store(DL + offs, dl, mask=mask)


def applies(logits: torch.Tensor) -> bool:
    """True where :func:`sinkhorn` runs: float32 logits [..., hc, hc] on a GPU, hc a power of two <= 16."""
    hc = logits.shape[-1] if logits.dim() >= 2 else 0
    return (logits.is_cuda and logits.dtype == torch.float32 and logits.shape[-2] == hc and 0 < hc <= 16
            and hc & (hc - 1) == 0)


def _launch(kernel, logits: torch.Tensor, *grads: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Run ``kernel`` over the tokens of ``logits`` [..., hc, hc] (and ``grads`` of the same shape); returns its
    output, a new tensor shaped like ``logits``."""
    x = logits.contiguous()
    out = torch.empty_like(x)
    hc = x.shape[-1]
    n = x.numel() // (hc * hc)
    if n:
        wrap_triton(kernel)[(triton.cdiv(n, BLOCK_TOKENS),)](
            x, *(g.contiguous() for g in grads), out, n, iters, EPS=eps, HC=hc, BLOCK=BLOCK_TOKENS, num_warps=1)
    return out


@triton_op("v4launch::sinkhorn", mutates_args=())
def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic mixing matrices: logits [..., hc, hc] float32 -> same shape (rows j = source
    stream), as ``mhc.sinkhorn`` (``iters >= 1`` rounds, ``eps`` in every denominator). Differentiable
    in ``logits``. Requires :func:`applies`."""
    return _launch(_sinkhorn_fwd_kernel, logits, iters=iters, eps=eps)


@triton_op("v4launch::sinkhorn_backward", mutates_args=())
def sinkhorn_backward(logits: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Gradient of :func:`sinkhorn` with respect to ``logits`` [..., hc, hc] given ``grad`` (same shape,
    float32): recomputes the rounds from the logits (module docstring). Requires :func:`applies`."""
    return _launch(_sinkhorn_bwd_kernel, logits, grad, iters=iters, eps=eps)


def _setup_context(ctx, inputs, output) -> None:
    logits, iters, eps = inputs
    ctx.save_for_backward(logits)
    ctx.iters, ctx.eps = iters, eps


def _backward(ctx, grad):
    (logits,) = ctx.saved_tensors
    return sinkhorn_backward(logits, grad, ctx.iters, ctx.eps), None, None


sinkhorn.register_autograd(_backward, setup_context=_setup_context)

