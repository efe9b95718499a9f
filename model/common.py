"""Shared building blocks: RMSNorm, accumulation dtype, FP32 pinning.

Spec: reference/v4-model-spec.md §1 ("Parameter dtypes") and §2 (RMSNorm in fp32).
Upstream: ``RMSNorm`` and the ``set_dtype(torch.float32)`` parameter blocks in the
released ``inference/model.py``. Seed 004 items 6f/9: ``ape`` / ``attn_sink`` must
not be taken down by ``module.bfloat16()``; pinning is per owning module, so it also
holds when a sub-module is cast on its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Callable, Iterator

import torch
from torch import nn

from . import regions
from .matmul import project

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
        if regions.fused_here(x):  # one fused kernel each way on CUDA (model/regions.py)
            return regions.run(rms_norm, (0,), x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s math: x [rows, ..., d] (any dtype), weight [d] -> x's shape and dtype,
    ``weight * x * rsqrt(mean(x**2, -1) + eps)`` in the accumulation dtype. Source: upstream ``RMSNorm``; spec §2."""
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.to(acc) * y).to(x.dtype)


RMS_CHUNK_ROWS = 1 << 20  # vectors per chunk: a 2 GiB float32 transient at d = 512


class _RMSUnweighted(torch.autograd.Function):
    """y = x * r, r = rsqrt(mean(x^2) + eps) per vector, computed in the accumulation dtype in
    chunks of vectors. Saves x and r ([..., 1]) only: the query norm of a 128K-token CSA layer
    would otherwise hold float32 copies of [T, H, D] (16 GiB each) for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        ctx.shape = x.shape
        if regions.fused_here(x):  # one fused kernel, no float32 temporaries: no chunks (model/regions.py)
            y, r = regions.run(_rms_unweighted_forward, (0,), flat, eps)
        else:
            y = torch.empty_like(flat)
            r = torch.empty(flat.shape[0], 1, dtype=acc_dtype(x.dtype), device=x.device)
            for i in range(0, flat.shape[0], RMS_CHUNK_ROWS):
                rows = slice(i, i + RMS_CHUNK_ROWS)
                y[rows], r[rows] = _rms_unweighted_forward(flat[rows], eps)
        ctx.save_for_backward(flat, r)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        flat, r = ctx.saved_tensors
        dy = dy.reshape(flat.shape)
        if regions.fused_here(flat):
            return regions.run(_rms_unweighted_backward, (0, 1, 2), flat, r, dy).view(ctx.shape), None
        dx = torch.empty_like(flat)
        for i in range(0, flat.shape[0], RMS_CHUNK_ROWS):
            rows = slice(i, i + RMS_CHUNK_ROWS)
            dx[rows] = _rms_unweighted_backward(flat[rows], r[rows], dy[rows])
        return dx.view(ctx.shape), None


def _rms_unweighted_forward(flat: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`_RMSUnweighted`'s forward (the compiled region on CUDA; per chunk of rows elsewhere):
    flat [rows, d] -> (y [rows, d] in flat's dtype, r [rows, 1] in the accumulation dtype),
    r = rsqrt(mean(x^2) + eps)."""
    xf = flat.to(acc_dtype(flat.dtype))
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * r).to(flat.dtype), r


def _rms_unweighted_backward(flat: torch.Tensor, r: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """:class:`_RMSUnweighted`'s backward (as the forward, whole or per chunk): ``dx = r (g - y mean(g y))`` with
    y = x r, g = dy, in r's dtype (the rsqrt's derivative folded into the mean term); flat, dy [rows, d],
    r [rows, 1] -> dx [rows, d] in flat's dtype."""
    yf = flat.to(r.dtype) * r
    g = dy.to(r.dtype)
    return (r * (g - yf * (g * yf).mean(-1, keepdim=True))).to(flat.dtype)


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-vector RMS normalisation without a weight, in the accumulation dtype, cast back.

    Used for the per-head query norm (spec §2 query path step 3). [..., d] -> [..., d], x's dtype.
    Memory: x and one accumulation-dtype scalar per vector are kept for the backward (see
    ``_RMSUnweighted``); float32 temporaries are bounded by ``RMS_CHUNK_ROWS`` vectors.
    """
    return _RMSUnweighted.apply(x, eps)


def linear(x: torch.Tensor, layer: nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ layer.weight.T`` [..., out] with the result in ``dtype`` (default: the input dtype).

    float32 / float64 inputs: the product computed in ``dtype``. bf16 inputs (or autocast) with
    ``dtype=float32``: a bf16 tensor-core GEMM with float32 accumulation and output
    (``matmul.project``), not a float32 GEMM.

    A subclass of ``nn.Linear`` with its own ``forward`` (an FP8 training module that
    ``parallel/precision.py`` swapped in) runs that forward, so its own GEMM is the one used;
    its result is cast to ``dtype`` when one is given.
    """
    if type(layer).forward is not nn.Linear.forward and isinstance(layer, nn.Linear):
        y = layer(x)
        return y if dtype is None else y.to(dtype)
    return project(x, layer.weight, dtype)


def to_host(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors (name -> value) -> floats, read back in ONE device -> host transfer (the training
    step's loss sums and gradient norm; reading them one by one would wait on the device per value).
    Values are stacked as float64 on the first value's device (:class:`QueuedRead`, read at once)."""
    return QueuedRead(values).values()


class QueuedRead:
    """0-d tensors (name -> value) on their way to the host: stacked as float64 and copied into pinned host memory
    behind the work already queued on the device, without waiting for it. :meth:`values` waits for that copy
    only (a CUDA event), so a caller can queue the next step first and read this one while the GPU runs it.
    On the CPU the values are there at once.

    ``ready_at``: ``time.monotonic()`` when the values were known to be on the host: at construction on the CPU
    (the work that made them ran synchronously); on a GPU when :meth:`values` returned from the event (an upper
    bound: the copy may have landed earlier); None before that. On a GPU ``event`` is a timing event: with a
    :func:`device_mark` recorded before the work, ``mark.elapsed_time(read.event)`` is that work's device time
    in milliseconds."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.names = list(values)
        self.ready_at: float | None = None
        self.event: torch.cuda.Event | None = None
        self.host: torch.Tensor | None = None
        if not values:
            return
        first = values[self.names[0]]
        stacked = torch.stack([values[k].reshape(()).to(first.device, torch.float64) for k in self.names])
        if stacked.is_cuda:
            self.host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.host = stacked
            self.ready_at = time.monotonic()

    def values(self) -> dict[str, float]:
        """name -> float; waits for the device work queued before this read was, and for nothing queued after."""
        if self.host is None:
            return {}
        if self.event is not None and self.ready_at is None:
            self.event.synchronize()
            self.ready_at = time.monotonic()
        return dict(zip(self.names, self.host.tolist()))


def device_mark(device: torch.device) -> "torch.cuda.Event | None":
    """A timing event recorded now on ``device``'s current stream (None on a CPU): its timestamp is when the
    device reaches it, i.e. once the work queued before it is done, or now if the device is idle. With a later
    event ``e`` (e.g. ``QueuedRead.event``), ``mark.elapsed_time(e)`` is milliseconds of device time between."""
    if device.type != "cuda":
        return None
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


def on_device_count(n: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A row count as a 0-d int64 tensor on ``device``: ``n`` itself when it is one already, else filled
    there (``torch.as_tensor(n, device=...)`` would copy it from host memory, a wait on the GPU, and a copy
    a CUDA graph cannot capture)."""
    return n if isinstance(n, torch.Tensor) else torch.full((), n, dtype=torch.int64, device=device)


_SAVED_FOR_REPLAY: contextvars.ContextVar[bool | None] = contextvars.ContextVar("v4launch_saved_for_replay",
                                                                                 default=None)
"""True in the first pass of a recomputed region, False in its replay, None outside any (:func:`saved_for_replay`)."""


@contextlib.contextmanager
def saved_for_replay(value: bool) -> Iterator[None]:
    """Mark the code run inside as the first pass of a recomputed region (``value`` True: what it saves for
    backward is dropped and recomputed by the replay) or as the replay itself (False). Set by
    ``parallel/recompute.py`` around each region; read with :func:`forward_is_replayed_later` and
    :func:`forward_is_a_replay`."""
    token = _SAVED_FOR_REPLAY.set(value)
    try:
        yield
    finally:
        _SAVED_FOR_REPLAY.reset(token)


def forward_is_replayed_later() -> bool:
    """True inside the first pass of a recomputed region: its saved tensors are dropped and the region runs
    again in backward. The checkpoint matches the replay's saved tensors to the first pass's one by one, so
    both passes must save tensors of the same shapes and dtypes; a product the backward needs that the replay
    should not recompute (the warm-up KL's gradient, ``kernels.layer._DenseKL``) is kept on the autograd
    node itself instead (a ``ctx`` attribute, outside the saved tensors)."""
    return _SAVED_FOR_REPLAY.get() is True


def forward_is_a_replay() -> bool:
    """True inside the replay of a recomputed region (the checkpoint re-running it in backward): its outputs are
    thrown away, only the tensors it saves are used, so work that saves nothing may be skipped there."""
    return _SAVED_FOR_REPLAY.get() is False
