"""LM head fused with the token cross entropy, chunked over tokens (no [T, vocab] float32 product).

Spec: reference/v4-model-spec.md §3 ("Model": final ``hc_head`` + ``norm`` + shared ``head``;
"MTP": the same head); §1 (the LM head is float32 math). Issue 17: the LM and MTP heads were
two float32 [T x vocab] GEMMs on the CUDA cores plus a float32 [T, vocab] logits tensor kept
for the backward.

:func:`head_cross_entropy` computes ``sum_t [logsumexp_v(z_t) - z_t[label_t]]`` over rows with
``label_t != -100``, ``z = hidden @ weight.T``, ``chunk_rows`` rows at a time:

* forward: per chunk, the logits (a bf16 tensor-core GEMM with float32 accumulation and output
  for bf16 inputs, ``matmul.project``; the plain product for float32 / float64), their float32
  log-sum-exp and the target logit (``Backend.logsumexp_target``: one Triton pass over the chunk on
  SM90, ``kernels/triton_cross_entropy.py``; PyTorch elsewhere). When a gradient will be needed
  (grad mode on and hidden or weight requiring it) the same chunk's gradients are formed right there,
  while its logits exist: ``dz = softmax(z) - onehot`` on valid rows (``Backend.softmax_grad``),
  ``d hidden = dz @ weight`` ([T, d] float32), ``d weight += dz.T @ hidden`` (the weight's dtype for a
  bf16 / fp16 weight, else float32). The loss is the graph's last node, so its upstream gradient ``g``
  is one scalar, and the backward is ``g * d hidden``, ``g * d weight``: no logits GEMM is recomputed
  (2 x T x d x vocab FLOP per head saved; 4.3 TFLOP per step, ~6 ms on an H200, at the benchmark's
  shape), at the price of holding ``d weight`` ([V, d]) from the head's forward to its backward.
  Transient memory O(chunk_rows x vocab).

Math: the softmax cross entropy and its gradient ``softmax - onehot`` (any textbook; the same
as ``F.cross_entropy(..., reduction="sum", ignore_index=-100)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common import acc_dtype
from .kernels import reference
from .kernels.dispatch import Backend
from .matmul import LOW_PRECISION, addmm_wide_, low_dtype, mm_wide, project

IGNORE = -100
LOGIT_CHUNK_ELEMENTS = 1 << 28
"""Logits per chunk (rows x vocab): 1 GiB of float32 (2,076 rows at vocab 129,280)."""


_FUSED = {"on": True}


def set_fused_head(enabled: bool) -> None:
    """On (default): :meth:`HeadLogits.cross_entropy` is the chunked fused loss. Off: the whole logits
    tensor, then ``F.cross_entropy`` (for measuring the difference, ``train_step.py --no-fused-ce``)."""
    _FUSED["on"] = bool(enabled)


def chunk_rows_for(vocab: int, elements: int = LOGIT_CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one chunk's logits hold at most ``elements`` values (at least 1 row)."""
    return max(1, elements // max(vocab, 1))


def _operands(hidden: torch.Tensor, weight: torch.Tensor, low: torch.dtype | None):
    """(hidden, weight) in the GEMM operand dtype ``low`` (None: the accumulation dtype), and that
    accumulation dtype (float32, or float64 for a float64 model): the dtype of the logits."""
    acc = acc_dtype(hidden.dtype)
    dtype = acc if low is None else low
    return hidden.to(dtype), weight.to(dtype), acc


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """h [R, d] @ w.T [d, V] -> [R, V] in ``acc`` (wide accumulation for low-precision operands)."""
    return mm_wide(h, w.t(), acc) if h.dtype in LOW_PRECISION else h @ w.t()


class _ChunkedHeadCE(torch.autograd.Function):
    """Sum over valid rows of the cross entropy of ``hidden @ weight.T``, its gradients formed in the forward;
    see the module docstring. ``rows``: what provides ``logsumexp_target`` / ``softmax_grad`` (a ``Backend`` or
    ``kernels.reference``); ``grads``: form the gradients (False under ``torch.no_grad`` or for frozen inputs)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                low: torch.dtype | None, rows, grads: bool) -> torch.Tensor:
        h, w, acc = _operands(hidden, weight, low)
        need_h, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        dh = torch.empty(h.shape, dtype=acc, device=h.device) if need_h else None
        dw = torch.zeros(w.shape, dtype=acc if weight.dtype not in LOW_PRECISION else weight.dtype,
                         device=w.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=h.device)
        for i in range(0, h.shape[0], chunk):
            hc, lab = h[i:i + chunk], labels[i:i + chunk]
            z = _chunk_logits(hc, w, acc)  # [R, V]
            lse, loss = rows.logsumexp_target(z, lab)
            total = total + loss.sum()
            if need_h or need_w:
                # (softmax - onehot) [R, V] on valid rows, in the GEMM operand dtype (bf16 for a bf16 model)
                dz = rows.softmax_grad(z, lse, lab, (lab != IGNORE).to(acc), h.dtype)
                del z
                if need_h:
                    dh[i:i + chunk] = _wide_or_plain(dz, w, acc)
                if need_w:
                    addmm_wide_(dw, dz.t(), hc)
        ctx.grads = (dh, dw)  # not saved tensors: neither is an input or an output of this node
        ctx.h_dtype, ctx.w_dtype = hidden.dtype, weight.dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        dh, dw = ctx.grads
        ctx.grads = (None, None)
        # scaled in place: no second [V, d] buffer while the weight gradient is handed over
        return (dh.mul_(g).to(ctx.h_dtype) if dh is not None else None,
                dw.mul_(g).to(ctx.w_dtype) if dw is not None else None, None, None, None, None, None)


def _wide_or_plain(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return mm_wide(a, b, out_dtype) if a.dtype in LOW_PRECISION else (a @ b).to(out_dtype)


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk_rows: int | None = None, kernels: Backend | None = None) -> torch.Tensor:
    """Summed cross entropy of the logits ``hidden @ weight.T`` over rows with a label != -100.

    Args:
        hidden: [T, d] head input (any float dtype; bf16 runs on the tensor cores).
        weight: [V, d] head weight.
        labels: [T] int64 targets in [0, V) or -100 (ignored).
        chunk_rows: rows per chunk (default :func:`chunk_rows_for` (V)); memory O(chunk_rows x V).
        kernels: the attention backend whose ``logsumexp_target`` / ``softmax_grad`` run the per-chunk row
            passes (the Triton kernels on SM90: one pass over each float32 chunk instead of ~5); None: the
            PyTorch formulation (``kernels.reference``).
    Returns:
        0-d sum in float32 (float64 for float64 hidden); 0 when no row is valid. Gradients flow to
        hidden and weight; with grad mode on they are formed in this call (module docstring) and the
        backward scales them by the upstream gradient.
    Raises:
        ValueError: hidden / labels shapes disagree, or chunk_rows < 1.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"head_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels "
                         f"{tuple(labels.shape)}: need hidden [T, d], weight [V, d], labels [T]. "
                         "Fix: flatten the batch to THD rows before the head.")
    chunk = chunk_rows if chunk_rows is not None else chunk_rows_for(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_rows={chunk}: must be >= 1. Fix: pass a positive row count or None.")
    low = low_dtype(hidden)  # read before autocast is switched off for the custom function
    with torch.autocast(hidden.device.type, enabled=False):
        grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        return _ChunkedHeadCE.apply(hidden, weight, labels, chunk, low, kernels or reference, grads)


@dataclass(frozen=True)
class HeadLogits:
    """The LM head applied lazily: logits = ``hidden @ weight.T`` are only formed on request.

    hidden [T, d]; weight [V, d]. :meth:`cross_entropy` never builds the [T, V] product;
    :meth:`materialize` does (``return_logits=True``).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    kernels: Backend | None = None

    def materialize(self) -> torch.Tensor:
        """Logits [T, V] in float32 (float64 for a float64 model), via ``matmul.project``."""
        return project(self.hidden, self.weight, acc_dtype(self.hidden.dtype))

    def cross_entropy(self, labels: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
        """Summed cross entropy over labels != -100 (:func:`head_cross_entropy`)."""
        if not _FUSED["on"]:
            return F.cross_entropy(self.materialize(), labels, ignore_index=IGNORE, reduction="sum")
        return head_cross_entropy(self.hidden, self.weight, labels, chunk_rows, self.kernels)
