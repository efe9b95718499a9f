"""Shared building blocks: RMSNorm, accumulation dtype, FP32 pinning.

Spec: reference/v4-model-spec.md §1 ("Parameter dtypes") and §2 (RMSNorm in fp32).
Upstream: ``RMSNorm`` and the ``set_dtype(torch.float32)`` parameter blocks in the
released ``inference/model.py``. Seed 004 items 6f/9: ``ape`` / ``attn_sink`` must
not be taken down by ``module.bfloat16()``; pinning is per owning module, so it also
holds when a sub-module is cast on its own.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for softmax / norms / routing: float64 stays float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class FP32Pinned(nn.Module):
    """Mixin: the tensors named in ``_fp32_names`` (parameters or buffers of this very
    module) stay float32 when the module is cast to bfloat16/float16.

    A cast to float64 (``.double()``) still applies, so a float64 model is float64
    throughout. The original float32 values are kept (not round-tripped through
    bfloat16), and their ``.grad`` follows the parameter.
    """

    _fp32_names: tuple[str, ...] = ()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):  # noqa: D401
        pinned: set[int] = set()
        for name in self._fp32_names:
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor):
                pinned.add(id(t))
                if t.grad is not None:
                    pinned.add(id(t.grad))

        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if id(t) in pinned and out.dtype in _LOW_PRECISION:
                return t.to(device=out.device, dtype=torch.float32)
            return out

        return super()._apply(keep_fp32 if pinned else fn, recurse)


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight, computed in float32 (float64 for float64 input).

    ``y = weight * x * rsqrt(mean(x**2, -1) + eps)``; input [..., dim], output same
    shape and dtype as the input. Source: upstream ``RMSNorm``; spec §2.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = acc_dtype(x.dtype)
        xf = x.to(acc)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(acc) * y).to(x.dtype)


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-vector RMS normalisation without a weight, in the accumulation dtype, cast back.

    Used for the per-head query norm (spec §2 query path step 3). [..., d] -> [..., d].
    """
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def linear(x: torch.Tensor, layer: nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ layer.weight.T`` computed in ``dtype`` (default: the input dtype)."""
    dtype = dtype or x.dtype
    return torch.nn.functional.linear(x.to(dtype), layer.weight.to(dtype))
