"""Matrix products whose output is wider than their inputs: bf16 tensor-core GEMMs with float32 results.

Spec: reference/v4-model-spec.md §1 ("Parameter dtypes": router logits, compressor
projections, mHC mixing and the LM head are float32 math) and issue 17 (every GEMM on the
tensor cores). A float32 product of bf16 activations used to upcast both operands and run a
float32 GEMM on the CUDA cores; here the operands stay bf16 (a float32 weight, e.g. an
FP32-pinned ``hc_*_fn``, is rounded to bf16 for the product only) and the GEMM accumulates
and writes float32 (``torch.mm(..., out_dtype=torch.float32)`` on CUDA, an exact emulation
on other devices: the bf16 operands upcast, then one float32 product).

Precision contract of :func:`project` (x [..., K], weight [N, K] -> [..., N] in ``dtype``):

* float32 / float64 inputs without autocast: ``F.linear(x.to(dtype), weight.to(dtype))``,
  bit for bit the plain product (float64 and float32 models are unchanged).
* bf16 / fp16 inputs, or autocast on for the input's device: operands in the low dtype
  (autocast's dtype, else x's), float32 accumulation, output ``dtype``. Backward: both
  gradient GEMMs also run on the low dtype with float32 accumulation; the weight gradient
  is written in the weight's dtype (float32 for a float32 parameter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOW_PRECISION = (torch.bfloat16, torch.float16)

_WIDE = {"on": True}


def set_wide_gemm(enabled: bool) -> None:
    """On (default): wide products of bf16 operands as above. Off: the former float32 GEMM of upcast
    operands (for measuring the difference, e.g. ``benchmarks/train_step.py --no-wide-gemm``)."""
    _WIDE["on"] = bool(enabled)


_PROBED: dict[tuple[str, str], bool] = {}
"""(operation, device type) -> whether torch runs it correctly there (probed once, eagerly)."""


def _probe_mm(device: torch.device) -> bool:
    a = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
    return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32


def _probe_addmm(device: torch.device) -> bool:
    a = torch.arange(4, device=device, dtype=torch.float32).reshape(2, 2).to(torch.bfloat16)
    acc = torch.full((2, 2), 0.5, device=device)
    torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)  # in place, against the two-step sum
    return bool(torch.equal(acc, 0.5 + a.float() @ a.float()))


def _works(probe, device: torch.device) -> bool:
    """Whether ``probe`` (``_probe_mm``: ``mm(..., out_dtype=float32)``; ``_probe_addmm``: ``addmm(...,
    out_dtype=float32, out=acc)`` accumulating in place) runs on ``device``'s type; cached. Inside a traced
    region nothing is probed or read (CUDA builds of torch >= 2.8 have both): reading the cache there made
    dynamo guard on it, and a block traced before the first probe was compiled again after it (with
    ``compile.cuda_graph``, inside the capture, which failed it)."""
    if torch.compiler.is_compiling():
        return device.type == "cuda"
    key = (probe.__name__, device.type)
    if key not in _PROBED:
        try:
            _PROBED[key] = probe(device)
        except (RuntimeError, NotImplementedError, TypeError):
            _PROBED[key] = False
    return _PROBED[key]


def mm_wide(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` for 2-D low-precision a [M, K], b [K, N] (same dtype), accumulated in float32,
    returned in ``out_dtype`` [M, N].

    CUDA: one tensor-core GEMM writing ``out_dtype`` directly. Elsewhere (or where torch lacks
    ``mm(..., out_dtype)``): the operands upcast to float32 and multiplied, which is the same
    value up to the summation order. ``out_dtype == a.dtype`` is the plain product.
    """
    if out_dtype == a.dtype:
        return a @ b
    if a.is_cuda and _works(_probe_mm, a.device):
        return torch.mm(a, b, out_dtype=torch.float32).to(out_dtype)
    return (a.float() @ b.float()).to(out_dtype)


def addmm_wide_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in place for 2-D a [M, K], b [K, N] (same dtype) and acc [M, N] in a's dtype or wider,
    accumulated in float32 (float64 for float64 operands); returns acc.

    The GEMM adds into ``acc`` in its epilogue (``addmm_``; on CUDA for a float32 acc of bf16 / fp16 operands,
    ``addmm(..., out_dtype=float32)`` where it works, probed once): no [M, N] product is written and
    read back by a separate add, and a low-precision acc is rounded once per call instead of twice. Elsewhere
    ``acc += mm_wide(a, b, acc.dtype)``, the same value up to the summation order.
    """
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if a.is_cuda and a.dtype in LOW_PRECISION and acc.dtype == torch.float32 and _works(_probe_addmm, a.device):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    acc += mm_wide(a, b, acc.dtype) if a.dtype in LOW_PRECISION else (a @ b).to(acc.dtype)
    return acc


class _WideLinear(torch.autograd.Function):
    """y = x @ w.T with low-precision operands and a float32 (wide) result; see module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, low: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
        x_low, w_low = x.to(low), w.to(low)
        y = mm_wide(x_low.reshape(-1, x.shape[-1]), w_low.t(), out_dtype)
        ctx.save_for_backward(x_low, w_low)
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_low, w_low = ctx.saved_tensors
        g = dy.reshape(-1, dy.shape[-1]).to(w_low.dtype)  # [M, N]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = mm_wide(g, w_low, ctx.x_dtype).view(*x_low.shape)
        if ctx.needs_input_grad[1]:
            dw = mm_wide(g.t(), x_low.reshape(-1, x_low.shape[-1]), ctx.w_dtype)
        return dx, dw, None, None


def low_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The GEMM operand dtype for ``x``: autocast's dtype when autocast is on for x's device,
    else x's dtype if it is bf16/fp16, else None (full-precision product)."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype if x.dtype in LOW_PRECISION else None


def project(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T`` with the result in ``dtype``; see the module docstring.

    x [..., K]; weight [N, K] -> [..., N]. ``dtype=None``: ``F.linear(x, weight.to(x.dtype))``
    (autocast, when on, picks the GEMM dtype as for any linear). A wider ``dtype`` than the GEMM
    operands (float32 for bf16 activations or under autocast) runs as a bf16/fp16 GEMM with
    float32 accumulation (tensor cores), never as a float32 GEMM on the CUDA cores.
    """
    if dtype is None:
        return F.linear(x, weight.to(x.dtype))
    low = low_dtype(x)
    if low is None or dtype in LOW_PRECISION or not _WIDE["on"]:
        return F.linear(x.to(dtype), weight.to(dtype))
    with torch.autocast(x.device.type, enabled=False):
        return _WideLinear.apply(x, weight, low, dtype)
