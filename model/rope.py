"""Rotary position embedding with YaRN frequency interpolation (interleaved pairs).

Spec: reference/v4-model-spec.md §1 (per-layer RoPE choice, "no mscale anywhere") and
§2 ("RoPE details", compressed entries at position i·ratio, inverse RoPE on the output).
Upstream: ``precompute_freqs_cis`` and ``apply_rotary_emb`` in the released
``inference/model.py``. Seed 004 items 1, 2, 3 and 8.

Layout: the rotated channels are the LAST ``rope_head_dim`` channels of a vector;
channel pairs (2i, 2i+1) form one complex number. Angles are computed in float64 and
the rotation runs in float32 (float64 for float64 tensors). Rotation is never in
place, so a tensor saved for backward is never overwritten (seed 000 §10).
"""

from __future__ import annotations

import math

import torch

from . import regions
from .args import ModelArgs
from .common import acc_dtype


def yarn_inv_freq(rope_dim: int, theta: float, factor: float, original_seq_len: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """Inverse frequencies [rope_dim // 2] (float64, radians per token).

    ``original_seq_len > 0`` blends ``f / factor`` into the low frequencies with the
    DeepSeek-V3 linear ramp between the pairs whose wavelength makes ``beta_fast``
    and ``beta_slow`` turns over ``original_seq_len`` tokens (for theta=160000 and
    rope_dim=64 the ramp runs from pair 15 to pair 25). No attention mscale is
    derived from YaRN anywhere in V4 (spec §1). Source: upstream
    ``precompute_freqs_cis``.
    """
    freqs = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if original_seq_len <= 0:
        return freqs

    def pair_at(turns: float) -> float:  # (fractional) channel index whose wavelength gives `turns`
        return rope_dim * math.log(original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_at(beta_fast)), 0)
    high = min(math.ceil(pair_at(beta_slow)), rope_dim - 1)
    if high == low:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = high-frequency pair left untouched, 0 = fully interpolated
    return freqs / factor * (1 - keep) + freqs * keep


class RotaryEmbedding:
    """Per-layer RoPE table (not an ``nn.Module``: no state to save or cast).

    Ratio-0 layers (SWA and MTP) use ``rope_theta`` without YaRN; compressed layers
    use ``compress_rope_theta`` with YaRN, for q, window KV, compressed KV, indexer
    q/k and the output de-rotation alike (spec §1).
    """

    def __init__(self, args: ModelArgs, ratio: int) -> None:
        self.rope_dim = args.rope_head_dim
        if ratio:
            self.inv_freq = yarn_inv_freq(args.rope_head_dim, args.compress_rope_theta, args.rope_factor,
                                          args.original_seq_len, args.beta_fast, args.beta_slow)
        else:
            self.inv_freq = yarn_inv_freq(args.rope_head_dim, args.rope_theta, 1.0, 0, 0.0, 0.0)
        self.key = ("compressed" if ratio else "plain")

    @property
    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies [rope_dim // 2] float64 on the CPU (:func:`yarn_inv_freq`)."""
        return self._inv_freq

    @inv_freq.setter
    def inv_freq(self, value: torch.Tensor) -> None:
        self._inv_freq = value
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`inv_freq` on ``device``, copied there once. A copy per call from (pageable) host memory
        would be a host synchronisation per layer and batch on a GPU; ``V4Model.batch_context`` calls
        this before any compiled region runs, so the regions read the cached tensor."""
        got = self._on_device.get(device)
        if got is None:
            got = self._on_device[device] = self._inv_freq.to(device)
        return got

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions`` [N] (integer tokens) -> two [N, rope_dim // 2] tensors."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq_on(positions.device)[None, :]
        acc = acc_dtype(dtype)
        return angles.cos().to(acc), angles.sin().to(acc)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` (out of place).

    Args:
        x: [N, d] or [N, H, d]; channels ``d - rd .. d-1`` are rotated, interleaved pairs.
        cos, sin: [N, rd // 2] from :meth:`RotaryEmbedding.cos_sin`.
        inverse: rotate by the negative angle (the conjugate), used to de-rotate the
            attention output at the query position (spec §2 "Output" step 1).
    Returns:
        A new tensor of ``x``'s shape and dtype.
    """
    if regions.fused_here(x):  # one fused kernel each way on CUDA (model/regions.py)
        return regions.run(_rotate, (0, 1, 2), x, cos, sin, inverse)
    return _rotate(x, cos, sin, inverse)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """:func:`apply_rope`'s math (the compiled region on CUDA)."""
    rd = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    pairs = x[..., -rd:].to(cos.dtype).unflatten(-1, (-1, 2))  # [..., rd/2, 2]
    re, im = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rot = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rd], rot), dim=-1)
