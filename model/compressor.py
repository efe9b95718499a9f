"""KV compressor: learned, gated pooling of ``ratio`` tokens into one entry.

Spec: reference/v4-model-spec.md §2 "Compressor" (overlapping ratio 4, non-overlapping
ratio 128, softmax over slots per channel, RoPE at i·ratio, incomplete tails dropped).
Upstream: ``Compressor.forward`` (``start_pos == 0`` branch) and
``Compressor.overlap_transform`` in the released ``inference/model.py``.
Seed 004 item 2 (positions), seed 000 §4 (reset at segment boundaries).

Not simulated: the FP8 / FP4 quantisation-aware-training casts of the released code
(pure fake-quant; this reference runs at the model dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from .common import FP32Pinned, RMSNorm, acc_dtype, linear
from .matmul import low_dtype, project
from .packing import CompressPlan
from .rope import RotaryEmbedding, apply_rope


_HADAMARD: dict[tuple, torch.Tensor] = {}


def _sylvester(n: int, dtype: torch.dtype, device: torch.device, normalised: bool) -> torch.Tensor:
    """The Sylvester-Hadamard matrix [n, n], built in float64 on ``device`` and cast once to ``dtype``."""
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * n ** -0.5 if normalised else h).to(dtype)


def hadamard_matrix(n: int, dtype: torch.dtype, device: torch.device, normalised: bool = True) -> torch.Tensor:
    """Sylvester-Hadamard matrix [n, n] (symmetric; n a power of 2), built once per (n, dtype, device).

    ``normalised``: entries ``+-n**-0.5`` (orthogonal), so ``x @ H`` equals
    ``fast_hadamard_transform(x, scale=n**-0.5)`` used upstream (``rotate_activation``);
    else the +-1 signs (exact in bf16). Deterministic, not randomised (spec §2 "Indexer").
    The cached tensor is shared: do not modify it. Inside a compiled region the matrix is built in the
    graph instead (n^2 elements, n <= 128 here): a cache filled inside a traced call made the building
    call and the later ones compile to different graphs, and a recompute replay (which found the matrix
    cached) saved other tensors than its forward.

    Raises:
        ValueError: n is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard size n={n}: must be a power of two. Fix: use a power-of-two index_head_dim "
                         "or ModelArgs(use_hadamard=False).")
    if torch.compiler.is_compiling():
        return _sylvester(n, dtype, torch.device(device), normalised)
    key = (n, dtype, torch.device(device), normalised)
    if key not in _HADAMARD:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable by autograd later
            _HADAMARD[key] = _sylvester(n, dtype, torch.device(device), normalised)
    return _HADAMARD[key]


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` with the normalised Hadamard matrix of size n = x.shape[-1]: [..., n] -> [..., n], x's dtype.

    float32 / float64 (no autocast): ``(x @ H)`` in the accumulation dtype, as the upstream transform.
    bf16 / fp16 (or autocast): a bf16 GEMM against the exact +-1 signs with float32 accumulation and
    output (``matmul.project``, tensor cores), times ``n**-0.5`` in float32, rounded once to x's
    dtype; a float32 GEMM of upcast operands on the CUDA cores before (issue 17).
    """
    n, acc = x.shape[-1], acc_dtype(x.dtype)
    if low_dtype(x) is None:
        return (x.to(acc) @ hadamard_matrix(n, acc, x.device)).to(x.dtype)
    signs = hadamard_matrix(n, low_dtype(x), x.device, normalised=False)  # symmetric: its own transpose
    return (project(x, signs, acc) * n ** -0.5).to(x.dtype)


class Compressor(FP32Pinned):
    """Compress ``x`` [T, dim] into entries [C, head_dim] for one ratio.

    Ratio 128: entry i pools tokens 128i .. 128i+127 of its segment. Ratio 4
    (overlapping, ``coff = 2``): entry i pools 8 slots, the previous window
    (tokens 4i-4 .. 4i-1, channels ``[:d]`` of kv/score/ape; absent for i = 0) and the
    current window (tokens 4i .. 4i+3, channels ``[d:]``). Per channel,
    ``C_i = sum_j softmax_j(score_ij + ape_j) * kv_ij``. The pooled entry is cast to the
    model dtype, RMS-normed, and its last ``rope_head_dim`` channels are rotated at
    position ``i * ratio``. With ``rotate`` (indexer keys) a Hadamard rotation follows.
    Projections and pooling run in float32 (float64 for a float64 model).

    Parameters (released names): ``wkv.weight``, ``wgate.weight`` [coff*head_dim, dim],
    ``ape`` [ratio, coff*head_dim] (FP32-pinned), ``norm.weight`` [head_dim].
    """

    _fp32_names = ("ape",)

    def __init__(self, dim: int, head_dim: int, ratio: int, norm_eps: float, rotate: bool = False) -> None:
        super().__init__()
        if ratio not in (4, 128):
            raise ValueError(f"Compressor ratio={ratio}: must be 4 (CSA) or 128 (HCA). Fix: check compress_ratios.")
        self.ratio, self.head_dim, self.rotate = ratio, head_dim, rotate
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32))
        self.wkv = nn.Linear(dim, coff * head_dim, bias=False)
        self.wgate = nn.Linear(dim, coff * head_dim, bias=False)
        self.norm = RMSNorm(head_dim, norm_eps)

    def forward(self, x: torch.Tensor, plan: CompressPlan, rope: RotaryEmbedding) -> torch.Tensor:
        """x [T, dim] -> entries [C, head_dim] (model dtype); C = plan.n_entries may be 0."""
        r, d = self.ratio, self.head_dim
        acc = acc_dtype(x.dtype)
        kv = linear(x, self.wkv, acc)  # [T, coff*d]
        score = linear(x, self.wgate, acc)  # [T, coff*d]
        ape = self.ape.to(acc)
        cur = plan.start[:, None] + torch.arange(r, device=x.device)[None, :]  # [C, r] token ids
        kv_slots, score_slots = kv[cur], score[cur] + ape  # [C, r, coff*d]
        if self.overlap:
            prev = (cur - r).clamp_min(0)  # [C, r]
            has_prev = plan.has_prev[:, None, None]  # [C, 1, 1]
            kv_prev = torch.where(has_prev, kv[prev][..., :d], 0.0)  # [C, r, d]
            score_prev = torch.where(has_prev, score[prev][..., :d] + ape[:, :d], float("-inf"))
            kv_slots = torch.cat((kv_prev, kv_slots[..., d:]), dim=1)  # [C, 2r, d]
            score_slots = torch.cat((score_prev, score_slots[..., d:]), dim=1)  # [C, 2r, d]
        pooled = (kv_slots * score_slots.softmax(dim=1)).sum(dim=1)  # [C, d]
        out = self.norm(pooled.to(x.dtype))
        cos, sin = rope.cos_sin(plan.pos, x.dtype)
        out = apply_rope(out, cos, sin)
        if self.rotate:
            out = hadamard_rotate(out)
        return out
