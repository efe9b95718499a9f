"""The routed experts' SwiGLU MLP with its forward and input-gradient GEMMs in e4m3, the casts fused into producers.

``y = w2(swiglu(w1 x, w3 x))`` for rows grouped by expert, in one autograd function (:class:`Fp8ExpertMLP`).
Weights as stored: w13 [E, 2*inter, dim] (each expert's w1 over its w3), w2 [E, dim, inter]. ``A @ B^T`` below
multiplies each expert e's row group of A by B_e^T (``torch._scaled_grouped_mm`` with ``B.mT``); e4m3(B) casts each
row of B_e (each output column of the GEMM) with its own scale:

forward:   xq = e4m3(x) rowwise                      [M, dim]      (one cast: w1 and w3 run as one GEMM)
           g13 = xq @ e4m3(w13)^T                    [M, 2*inter]  bf16
           hq = e4m3(swiglu(g13)) rowwise            [M, inter]    (the SwiGLU and its cast: one compiled region)
           y = hq @ e4m3(w2)^T                       [M, dim]      bf16
backward:  dh = e4m3(dy) @ e4m3(w2^T)^T              [M, inter]    (w2^T cast along dim, per inter column)
           dg13, dg13q = swiglu'(g13, dh)            [M, 2*inter]  (recomputes h and casts dg13 in the same region)
           dx = dg13q @ e4m3(w13^T)^T                [M, dim]
           dw13 = dg13^T x, dw2 = dy^T h per expert  bf16 grouped GEMMs

The four e4m3 GEMMs are ``torch._scaled_grouped_mm`` (SM90) with one power-of-two scale per row of the left
operand and per output column of each expert's right operand (the recipe torchao's ``prototype.moe_training``
runs). The weight gradients stay bf16: in FP8 their operands need one scale per column of each expert's rows
(a second cast of x, h, dy and dg13) and every group padded to 16 rows; measured on an H100 at Flash width
(benchmarks/fp8_experts.py, results/fp8_experts_h100_2026-12-05.md) those casts cost what the FP8 GEMMs saved,
and the padding's copies cost ~15 ms more per layer. What this saves over torchao's
``_to_fp8_rowwise_then_scaled_grouped_mm`` per weight: x is cast once instead of twice, h and dg13 are cast
inside the SwiGLU regions that produce them instead of being written in bf16 and read back by a cast kernel, no
padding, and of the activations only x and g13 are saved for the backward (with the bf16 weight stacks the
caller built: ~384 MiB per layer at Flash width).

Scales: ``2^floor(log2(448 / amax))`` per row (power-of-two: scaling is exact, only the e4m3 rounding errs); a
zero row gets a finite scale and stays zero. Spec: seed 000 §9 (routed experts are FP8 GEMMs under the V4
policy); the released model's experts are e4m3 with per-block scales, which SM90's grouped kernel does not run
(rowwise is the nearest it does: ``parallel/precision.py``).

Off CUDA (tests) the e4m3 GEMMs run emulated: the e4m3 operands times their scales in float32 through
``torch._grouped_mm``, so the operands' rounding is the same; the accumulation differs (CUDA runs the kernel's fast
accumulation, ``use_fast_accum=True``, as torchao does).
"""

from __future__ import annotations


import torch

from . import regions

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def rowwise_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] (any float dtype) -> (q [..., k] e4m3, dequantisation scale [...] float32): one power-of-two
    scale per row (last dimension), ``q * scale[..., None]`` ~ x. An all-zero row stays zero, with a finite scale.
    The scale is ``2^floor(log2(448 / amax))``, so the row's amax lands in [224, 448] (e4m3's largest finite value is
    448). Source: the rowwise recipe of torchao's float8 training (power-of-two scales rounded down)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=1e-30)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    q = (xf * scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.reciprocal()


def _swiglu_f32(g13: torch.Tensor, limit: float) -> tuple[torch.Tensor, ...]:
    """g13 [n, 2*inter] -> (gate, up, clamped gate, clamped up, sigmoid of the clamped gate), float32."""
    gate, up = g13.float().chunk(2, dim=-1)
    gc, uc = (gate.clamp(max=limit), up.clamp(-limit, limit)) if limit > 0 else (gate, up)
    return gate, up, gc, uc, torch.sigmoid(gc)


def swiglu_e4m3(g13: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` cast rowwise to e4m3: g13 [n, 2*inter] (gate | up) ->
    (hq [n, inter] e4m3, scale [n] float32). Math in float32 (``moe.swiglu``'s; L = 0: no clamp)."""
    _, _, gc, uc, s = _swiglu_f32(g13, limit)
    return rowwise_e4m3(gc * s * uc)


def swiglu_grad_e4m3(g13: torch.Tensor, dh: torch.Tensor, limit: float) -> tuple[torch.Tensor, ...]:
    """The SwiGLU backward with h recomputed: g13 [n, 2*inter], dh [n, inter] (d loss / d h) ->
    (dg13q [n, 2*inter] e4m3, its scale [n] float32, dg13 [n, 2*inter] in g13's dtype, h [n, inter] in g13's dtype).

    ``d silu(z)/dz = s (1 + z (1 - s))`` with s = sigmoid(z); a clamp passes the gradient where its input is inside
    the bounds, ends included (torch.clamp's convention).
    """
    gate, up, gc, uc, s = _swiglu_f32(g13, limit)
    silu = gc * s
    d = dh.float()
    dgate, dup = d * uc * s * (1 + gc * (1 - s)), d * silu
    if limit > 0:
        dgate, dup = dgate * (gate <= limit), dup * ((up >= -limit) & (up <= limit))
    dg13 = torch.cat([dgate, dup], dim=-1)
    dq, ds = rowwise_e4m3(dg13)
    return dq, ds, dg13.to(g13.dtype), (silu * uc).to(g13.dtype)


def _fused(fn, row_args: tuple[int, ...], *args):
    """``fn(*args)`` as a compiled region on CUDA (``regions.run``), plainly elsewhere."""
    return regions.run(fn, row_args, *args) if regions.fused_here(args[0]) else fn(*args)


def cast_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rowwise_e4m3` of a contiguous tensor as a compiled region on CUDA (one kernel instead of the eager
    chain's ~10 passes over a float32 copy: at Flash width a weight stack is 67M-134M elements, x 1.6G), the
    e4m3 output made contiguous (the grouped GEMM's layout contract: row-major left, column-major right via ``.mT``)."""
    q, scale = _fused(rowwise_e4m3, (0,), t)
    return q.contiguous(), scale


def _scaled_grouped_mm(aq: torch.Tensor, a_scale: torch.Tensor, bq_t: torch.Tensor, b_scale: torch.Tensor,
                       ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Grouped e4m3 GEMM, dequantised: ``(aq * a_scale) @ (bq_t * b_scale)`` per group of rows, -> out_dtype.

    aq [M, K] row-major, a_scale [M] float32; bq_t [E, K, N] column-major, b_scale [E, N] float32; ends [E] int32
    (group g = rows ends[g-1]:ends[g]) -> [M, N]. ``torch._scaled_grouped_mm`` on CUDA (fast accumulation, as
    torchao runs it); off CUDA the same dequantised operands through ``torch._grouped_mm`` in float32.
    """
    if aq.is_cuda:
        return torch._scaled_grouped_mm(aq, bq_t, a_scale, b_scale, offs=ends, out_dtype=out_dtype,
                                        use_fast_accum=True)
    a, b = aq.float() * a_scale[:, None], bq_t.float() * b_scale[:, None, :]
    return torch._grouped_mm(a, b, offs=ends).to(out_dtype)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [n, k] e4m3, scale [n] float32 -> ``q * scale[:, None]`` [n, k] in ``dtype``: exact in bf16 (an e4m3 value
    times a power of two has 3 mantissa bits), as a compiled region on CUDA."""
    return _fused(_dequantize, (0, 1), q, scale, dtype)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def mlp_forward(xq: torch.Tensor, xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor,
                limit: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of the module docstring from the cast input: xq [M, dim] e4m3, xs [M] float32, w13, w2 and
    ends as :class:`Fp8ExpertMLP` -> (y [M, dim], g13 [M, 2*inter]) in ``dtype`` (g13 is what the backward keeps)."""
    w13q, w13s = cast_rows(w13)  # [E, 2I, dim]: one scale per output column of each expert
    g13 = _scaled_grouped_mm(xq, xs, w13q.mT, w13s, ends, dtype)
    hq, hs = _fused(swiglu_e4m3, (0,), g13, float(limit))
    w2q, w2s = cast_rows(w2)
    return _scaled_grouped_mm(hq, hs, w2q.mT, w2s, ends, dtype), g13


def mlp_backward(dyq: torch.Tensor, dys: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, g13: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor, limit: float,
                 weight_grads: tuple[bool, bool]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward of the module docstring: dyq [M, dim] e4m3 / dys [M] float32 (the cast output gradient, for the
    dh GEMM), dy and x [M, dim] in the compute dtype (the weight gradients' operands), g13 from :func:`mlp_forward`
    -> (dx [M, dim], dw13 [E, 2I, dim] or None, dw2 [E, dim, I] or None, as ``weight_grads`` asks)."""
    dtype = x.dtype
    w2tq, w2ts = cast_rows(w2.mT.contiguous())  # [E, inter, dim]: scales along dim, per inter column
    dh = _scaled_grouped_mm(dyq, dys, w2tq.mT, w2ts, ends, dtype)
    dg13q, dg13s, dg13, h = _fused(swiglu_grad_e4m3, (0, 1), g13, dh, limit)
    w13tq, w13ts = cast_rows(w13.mT.contiguous())  # [E, dim, 2I]
    dx = _scaled_grouped_mm(dg13q, dg13s, w13tq.mT, w13ts, ends, dtype)
    dw13 = torch._grouped_mm(dg13.T, x, offs=ends) if weight_grads[0] else None  # [E, 2I, dim]
    dw2 = torch._grouped_mm(dy.T, h, offs=ends) if weight_grads[1] else None  # [E, dim, I]
    return dx, dw13, dw2


class Fp8ExpertMLP(torch.autograd.Function):
    """See the module docstring. forward(x [M, dim] bf16, w13 [E, 2*inter, dim] bf16, w2 [E, dim, inter] bf16,
    ends [E] int32, limit) -> y [M, dim] bf16. The weight gradients use x and dy as given (bf16)."""

    @staticmethod
    def forward(ctx, x, w13, w2, ends, limit: float):
        x = x.contiguous()
        xq, xs = cast_rows(x)
        y, g13 = mlp_forward(xq, xs, w13, w2, ends, limit, x.dtype)
        ctx.save_for_backward(x, g13, w13, w2, ends)
        ctx.limit = float(limit)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g13, w13, w2, ends = ctx.saved_tensors
        dy = dy.to(x.dtype).contiguous()
        dyq, dys = cast_rows(dy)
        dx, dw13, dw2 = mlp_backward(dyq, dys, dy, x, g13, w13, w2, ends, ctx.limit, ctx.needs_input_grad[1:3])
        return dx, dw13, dw2, None, None


def check_widths(dim: int, inter: int) -> None:
    """Raises ValueError unless ``dim`` and ``inter`` are multiples of 16 (the e4m3 grouped GEMM's alignment)."""
    if dim % 16 or inter % 16:
        raise ValueError(f"FP8 grouped GEMMs need widths that are multiples of 16: dim {dim}, inter {inter}")


@torch.compiler.disable
def fp8_expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                   limit: float) -> torch.Tensor:
    """The routed experts' MLP with e4m3 forward and input-gradient GEMMs (:class:`Fp8ExpertMLP`).

    Never traced into a compiled block (``torch.compiler.disable``; its casts run as their own compiled regions):
    traced, inductor chose its own layouts for the grouped GEMMs' operands, and a weight gradient's transposed
    operand laid out row-major makes the grouped GEMM require every expert's row count to be a multiple of 8,
    which routing does not give (a device-side assert in ``prepare_grouped_gemm_data`` on an H100).

    Args:
        x: [M, dim] rows grouped by expert (the first ``counts[0]`` for expert 0, ...); bf16 (float32 off CUDA).
        w13: [E, 2*inter, dim] each expert's w1 weight over its w3 weight, in x's dtype.
        w2: [E, dim, inter].
        counts: [E] int64 rows per expert, on x's device (never read on the host).
        limit: the SwiGLU clamp L (0 = none).
    Returns: [M, dim] in x's dtype. An expert with no rows gets weight gradients that are exactly zero.
    Raises: ValueError for widths that are not multiples of 16 (the e4m3 GEMM's alignment).
    Source: seed 000 §9 (routed experts are FP8 GEMMs under the V4 policy); the math is ``moe.Expert``'s.
    """
    check_widths(x.shape[-1], w2.shape[-1])
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    return Fp8ExpertMLP.apply(x, w13, w2, ends, float(limit))


__all__ = ["E4M3", "E4M3_MAX", "Fp8ExpertMLP", "cast_rows", "check_widths", "dequantize_rows", "fp8_expert_mlp", "mlp_backward", "mlp_forward",
           "rowwise_e4m3", "swiglu_e4m3", "swiglu_grad_e4m3"]
