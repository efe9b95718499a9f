"""Manifold-constrained hyper-connections (mHC): residual streams mixed per sub-layer.

Spec: reference/v4-model-spec.md §3 "mHC (per sub-layer)" and "Model" (head mixing);
§4 item 5 (row softmax first, then Sinkhorn).
Upstream: ``Block.hc_pre`` / ``Block.hc_post`` / ``ParallelHead.hc_head`` in the
released ``inference/model.py`` and ``hc_split_sinkhorn`` in ``inference/kernel.py``.

Shapes: streams X [T, hc, dim]; ``fn`` [(2+hc)*hc, hc*dim]; ``base`` [(2+hc)*hc];
``scale`` [3]. All mixing math runs in float32 (float64 for a float64 model); the
block input and new streams are cast back to the stream dtype.

Speed (issue 17): eager, one mixing is ~40 small kernels (the Sinkhorn rounds on [T, hc, hc]
alone are 4 per round) plus float32 copies of the [T, hc, dim] streams. On CUDA the part after
the projection GEMM (:func:`hc_pre_tail`) and :func:`hc_post_fused` run as ``torch.compile``d
regions (a few fused kernels, no float32 stream copies) and the Sinkhorn rounds as one Triton
kernel each way (``kernels/triton_sinkhorn.py``: compiled, the rounds' chain of small reductions
was still ~150 launches per mixing and bound the step on the host); elsewhere, and with
:func:`set_fused_mixing` (False), the eager code below runs. Same math; the fused form writes
``sum_j comb[j, k] X_j`` as a broadcast reduction instead of a batched 4 x 4 GEMM.
"""

from __future__ import annotations

import torch

from . import regions
from .common import acc_dtype
from .matmul import low_dtype, project


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten streams and project: returns (flat [T, hc*dim], mixes [T, n_mix]) in acc dtype.

    ``mixes = (flat @ fn.T) * rsqrt(mean(flat**2) + norm_eps)`` (unweighted RMS norm over hc*dim).
    bf16 streams: the product is a bf16 GEMM with float32 accumulation and output
    (``matmul.project``); float32 / float64 streams: the plain product in that dtype.
    """
    acc = acc_dtype(x.dtype)
    flat = x.flatten(1).to(acc)  # [T, hc*dim]
    rs = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    src = flat if low_dtype(x) is None else x.flatten(1)  # bf16 operand: no float32 copy in the GEMM
    return flat, project(src, fn, acc) * rs


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic mixing matrix from logits [..., hc, hc] (rows j = source stream).

    Row softmax, ``+ eps``, divide by column sums ``(+ eps)``, then ``iters - 1`` rounds of
    row then column normalisation (each ``+ eps`` in the denominator). Source:
    ``hc_split_sinkhorn`` kernel.

    On CUDA with the fused mixing on (:func:`set_fused_mixing`) and float32 logits, one Triton
    kernel per direction (``kernels/triton_sinkhorn.py``; same math, the rounds in registers)
    instead of ~4 PyTorch kernels per round forward and more backward.
    """
    if _FUSED["on"] and logits.is_cuda:
        from .kernels import triton_sinkhorn  # imports Triton: only on CUDA

        if triton_sinkhorn.applies(logits):
            return triton_sinkhorn.sinkhorn(logits, iters, eps)
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduce streams to one block input and compute the post/comb weights.

    Returns:
        y [T, dim] = sum_j pre_j X_j (stream dtype), with pre = sigmoid(m[:hc]*s0 + b) + hc_eps;
        post [T, hc] = 2 * sigmoid(m[hc:2hc]*s1 + b);
        comb [T, hc, hc] = sinkhorn(m[2hc:]*s2 + b), comb[j, k] weighs source j into stream k.
    """
    if _fused_here(x):
        raw = project(x.flatten(1), fn, acc_dtype(x.dtype))
        return regions.run(hc_pre_tail, ROW_ARGS["pre"], x, raw, scale, base, iters, hc_eps, norm_eps)
    T, hc, dim = x.shape
    flat, m = _mixes(x, fn, norm_eps)
    acc = flat.dtype
    scale, base = scale.to(acc), base.to(acc)
    z = m  # [T, n_mix]
    pre = torch.sigmoid(z[:, :hc] * scale[0] + base[:hc]) + hc_eps  # [T, hc]
    post = 2 * torch.sigmoid(z[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])  # [T, hc]
    comb = sinkhorn((z[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(T, hc, hc), iters, hc_eps)
    y = (pre.unsqueeze(-1) * flat.view(T, hc, dim)).sum(dim=1)  # [T, dim]
    return y.to(x.dtype), post, comb


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: ``X'_k = post_k * F + sum_j comb[j, k] * X_j``.

    f [T, dim] (sub-layer output), residual [T, hc, dim] -> [T, hc, dim] in f's dtype.
    """
    if _fused_here(f):
        return regions.run(hc_post_fused, ROW_ARGS["post"], f, residual, post, comb)
    return _hc_post_eager(f, residual, post, comb)


def _hc_post_eager(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """:func:`hc_post` eagerly: the stream mixing as a batched product (no [T, hc, hc, dim] intermediate)."""
    acc = post.dtype
    mixed = torch.einsum("tjk,tjd->tkd", comb, residual.to(acc))  # [T, hc, dim]
    return (post.unsqueeze(-1) * f.to(acc).unsqueeze(1) + mixed).to(f.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final stream reduction before the last norm: ``sum_j (sigmoid(m_j*s + b_j) + hc_eps) X_j``.

    x [T, hc, dim]; fn [hc, hc*dim]; scale [1]; base [hc] -> [T, dim] (stream dtype). No Sinkhorn.
    """
    T, hc, dim = x.shape
    flat, m = _mixes(x, fn, norm_eps)
    pre = torch.sigmoid(m * scale.to(flat.dtype) + base.to(flat.dtype)) + hc_eps  # [T, hc]
    return (pre.unsqueeze(-1) * flat.view(T, hc, dim)).sum(dim=1).to(x.dtype)


# ------------------------------------------------------------------ fused (compiled) mixing
_FUSED = {"on": True}


def set_fused_mixing(enabled: bool) -> None:
    """Turn the compiled mHC regions on CUDA on (default) or off (eager everywhere)."""
    _FUSED["on"] = bool(enabled)


def _fused_here(t: torch.Tensor) -> bool:
    return _FUSED["on"] and t.is_cuda and t.dtype != torch.float64


ROW_ARGS = {"pre": (0, 1), "post": (0, 1, 2, 3)}
"""Positions of the arguments with one row per token (dim 0 = T) of :func:`hc_pre_tail` (x, raw) and
:func:`hc_post_fused` (f, residual, post, comb); ``scale`` and ``base`` are per-layer parameters. The regions
(``regions.run``) keep only these rows dynamic: compiled with every dimension dynamic (before 2026-12-05) inductor
could not unroll the sum over the hc = 4 streams and wrote ``sum_j comb[j, k] X_j`` as a looped reduction of 4
over [T x hc x dim] outputs with symbolic div/mod indexing (``triton_red_fused__to_copy_add_mul_sum_unsqueeze_0``,
281 ms in 16 calls of the 3.9 s Flash-width sparse step on the H200, where ~5 GB of traffic needs ~1.3 ms per
call)."""


def hc_pre_tail(x: torch.Tensor, raw: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
                hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hc_pre` after its projection GEMM, written for fusion: x [T, hc, dim] streams,
    raw = x.flatten(1) @ fn.T [T, n_mix] (accumulation dtype) -> (y, post, comb) as hc_pre."""
    T, hc, dim = x.shape
    acc = raw.dtype
    xf = x.to(acc)
    rs = torch.rsqrt(xf.square().mean(dim=(1, 2)) + norm_eps)[:, None]  # [T, 1]: RMS over hc*dim
    z = raw * rs
    scale, base = scale.to(acc), base.to(acc)
    pre = torch.sigmoid(z[:, :hc] * scale[0] + base[:hc]) + hc_eps  # [T, hc]
    post = 2 * torch.sigmoid(z[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])  # [T, hc]
    comb = sinkhorn((z[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(T, hc, hc), iters, hc_eps)
    y = (pre.unsqueeze(-1) * xf).sum(dim=1)  # [T, dim]
    return y.to(x.dtype), post, comb


def hc_post_fused(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """:func:`hc_post` written for fusion: ``sum_j comb[:, j, k] X_j`` as a broadcast reduction.

    Run eagerly (dynamo gave up on a call, e.g. past its recompile limit) the broadcast would materialise
    [T, hc, hc, dim] in the accumulation dtype, 4 x the streams: the eager form runs instead.
    """
    if not torch.compiler.is_compiling():
        return _hc_post_eager(f, residual, post, comb)
    acc = post.dtype
    mixed = (comb.unsqueeze(-1) * residual.to(acc).unsqueeze(2)).sum(dim=1)  # [T, j, k, 1]*[T, j, 1, d] -> [T, k, d]
    return (post.unsqueeze(-1) * f.to(acc).unsqueeze(1) + mixed).to(f.dtype)
