"""Triton kernels: the row passes of the chunked LM-head cross entropy (``model/loss.py``).

The head's logits chunk ``z`` [R, V] float32 (``R`` rows of ``hidden @ weight.T``; ``V`` the vocab) is
read once per pass instead of once per PyTorch elementwise operation:

* :func:`logsumexp_target` (forward): one program per row walks the vocab in blocks of
  ``BLOCK_V`` with a running maximum and rescaled sum (the online log-sum-exp), and reads the target
  logit: ``lse[r] = log sum_v exp z[r, v]``, ``loss[r] = lse[r] - z[r, label[r]]`` (0 where
  ``label[r] == -100``). One read of ``z``.
* :func:`softmax_grad` (backward): ``dz[r, v] = scale[r] * (exp(z[r, v] - lse[r]) - [v == label[r]])``
  written straight in the GEMM operand dtype (bf16 for a bf16 model). One read of ``z``, one write.

The PyTorch formulation of the same two steps (``reference.logsumexp_target`` /
``reference.softmax_grad``) makes ~5 passes over ``z`` in the forward (max, subtract, exp, sum,
gather) and ~5 in the backward (subtract, exp, scatter, multiply, cast), each over 1 GiB of float32 per
chunk at the benchmark's shape (2,076 rows x vocab 129,280): ~30 ms of elementwise work per
sparse benchmark step on an H200 (benchmarks/results/train_step_h200.md). No atomics: the result is
the same on every run. Math: the softmax cross entropy and its gradient ``softmax - onehot``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096
IGNORE = -100


@triton.jit
def _lse_target_kernel(Z, LAB, LSE, LOSS, V, sz, BLOCK: tl.constexpr, IGNORE_INDEX: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = Z + r * sz
    m = -float("inf")
    s = 0.0
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < V, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(x, 0))  # finite: every block holds at least one logit
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    lab = tl.load(LAB + r)
    valid = lab != IGNORE_INDEX
    target = tl.load(row + tl.where(valid, lab, 0))
    tl.store(LSE + r, lse)
    tl.store(LOSS + r, tl.where(valid, lse - target, 0.0))


@triton.jit
def _softmax_grad_kernel(Z, LSE, LAB, SCALE, DZ, V, sz, sdz, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(Z + r * sz + offs, mask=mask, other=0.0)
    lse = tl.load(LSE + r)
    scale = tl.load(SCALE + r)
    lab = tl.load(LAB + r)
    p = tl.exp(x - lse)
    dz = tl.where(offs == lab, p - 1.0, p) * scale
    tl.store(DZ + r * sdz + offs, dz.to(DZ.dtype.element_ty), mask=mask)


def _check(z: torch.Tensor, labels: torch.Tensor) -> None:
    if z.dim() != 2 or z.dtype != torch.float32 or z.stride(1) != 1 or labels.shape != z.shape[:1]:
        raise ValueError(f"cross-entropy rows: z {tuple(z.shape)} {z.dtype} stride {z.stride()}, labels "
                         f"{tuple(labels.shape)}: need z [R, V] float32 with unit column stride and labels [R]. "
                         "Fix: pass the head's float32 logits chunk (supported() says which inputs qualify).")


@torch.compiler.disable
def logsumexp_target(z: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-sum-exp and cross entropy of a logits chunk, in one pass over it.

    Args:
        z: [R, V] float32 logits (CUDA, unit column stride).
        labels: [R] int64 targets in [0, V) or -100 (ignored; ``model.check_ids`` has checked the range).
    Returns:
        (lse [R] float32, loss [R] float32: ``lse - z[r, label]``, 0 on ignored rows).
    Raises:
        ValueError: shapes, dtype or layout other than the above.
    """
    _check(z, labels)
    R, V = z.shape
    lse = torch.empty(R, dtype=torch.float32, device=z.device)
    loss = torch.empty(R, dtype=torch.float32, device=z.device)
    if R:
        _lse_target_kernel[(R,)](z, labels.contiguous(), lse, loss, V, z.stride(0), BLOCK=BLOCK_V,
                                 IGNORE_INDEX=IGNORE, num_warps=8)
    return lse, loss


@torch.compiler.disable
def softmax_grad(z: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Gradient of the summed cross entropy in the logits: ``scale[r] * (softmax(z[r]) - onehot(label[r]))``.

    Args:
        z: [R, V] float32 logits (the chunk the caller holds); lse: [R] float32 from :func:`logsumexp_target`.
        labels: [R] int64 (-100: ignored; its row's ``scale`` must be 0).
        scale: [R] float32 per-row factor (the incoming gradient times the row's validity).
        out_dtype: dtype of the result (the GEMM operand dtype: bf16, fp16 or float32).
    Returns:
        dz [R, V] in ``out_dtype``.
    Raises:
        ValueError: as :func:`logsumexp_target`.
    """
    _check(z, labels)
    R, V = z.shape
    dz = torch.empty(R, V, dtype=out_dtype, device=z.device)
    if R:
        _softmax_grad_kernel[(R, triton.cdiv(V, BLOCK_V))](
            z, lse.contiguous(), labels.contiguous(), scale.to(torch.float32).contiguous(), dz, V, z.stride(0),
            dz.stride(0), BLOCK=BLOCK_V, num_warps=8)
    return dz


def supported(z: torch.Tensor) -> bool:
    """Inputs the kernels take: a float32 CUDA logits chunk with unit column stride (a float64 model's
    logits, and CPU tensors, run the PyTorch formulation)."""
    return z.is_cuda and z.dtype == torch.float32 and z.dim() == 2 and z.stride(1) == 1
