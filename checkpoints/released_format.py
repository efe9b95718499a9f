"""The released DeepSeek-V4 checkpoint format: which tensor is stored how, and its exact codecs.

Spec: reference/v4-model-spec.md §1 "Parameter dtypes". A released directory holds
``config.json``, ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file)
and the shards. Tensor names are the bundled model's parameter and buffer names (FQNs)
unchanged -- ``embed.weight``, ``layers.N.attn.wq_a.weight``, ``mtp.0.e_proj.weight`` ... --
plus one ``<module>.scale`` beside each quantised ``<module>.weight``. The released index
(V4-Flash, 82 distinct name patterns) has no name the model lacks and vice versa, so the
name mapping is the identity; the one table below says how each name is stored:

=================  ==============================================================  ===========================
storage            tensors (FQN patterns)                                          on disk
=================  ==============================================================  ===========================
``fp8``            ``attn.{wq_a,wq_b,wkv,wo_a,wo_b}.weight``,                      F8_E4M3 [out, in] +
                   ``attn.indexer.wq_b.weight``, ``ffn.shared_experts.w{1,2,3}``,  ``.scale`` F8_E8M0
                   ``mtp.K.{e_proj,h_proj}.weight``                                [ceil(out/128), ceil(in/128)]
``fp4``            routed experts ``ffn.experts.E.w{1,2,3}.weight``                I8 [out, in/2] (two e2m1
                                                                                   codes per byte, low nibble
                                                                                   first) + ``.scale`` F8_E8M0
                                                                                   [out, in/32]
``fp32``           ``attn_sink``, ``compressor.ape``, every ``hc_*``,              F32
                   ``ffn.gate.bias``
``index``          ``ffn.gate.tid2eid`` (hash layers)                              I32 (I64 also read)
``bf16``           everything else: ``embed``, ``head``, norms, ``gate.weight``,   BF16
                   ``indexer.weights_proj``, compressor ``wkv`` / ``wgate``
=================  ==============================================================  ===========================

An export without ``--quantize`` stores the ``fp8`` / ``fp4`` tensors as BF16 with no
``.scale``; the import reads either form.

Codecs (all exact, no rounding on the way in): e4m3 and e2m1 values times a power-of-two
ue8m0 scale ``2^(byte - 127)`` (byte 255 is NaN) have at most 4 significant bits, so their
product is exact in float32 (and in BF16). The quantisers pick the smallest power-of-two scale
with ``amax / scale <= max code`` (448 for e4m3, 6 for e2m1) and round to nearest, ties to
even, so quantising a dequantised tensor gives back the same values (a block whose largest code
rounded down may get half the scale and doubled codes: other bytes, equal values).
"""

from __future__ import annotations

import re
from typing import Literal

import torch

Storage = Literal["fp8", "fp4", "bf16", "fp32", "index"]

FP8_BLOCK = 128
"""Side of the square weight block that shares one e8m0 scale (``weight_block_size`` [128, 128])."""
FP4_BLOCK = 32
"""Consecutive input elements of one row that share one e8m0 scale."""
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the e2m1 codes 0..7; bit 3 is the sign."""

SAFETENSORS_DTYPE: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "BF16": torch.bfloat16,
    "F32": torch.float32, "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "F64": torch.float64,
}

_FP8 = re.compile(r"(^|\.)attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.attn\.indexer\.wq_b\.weight$"
                  r"|\.ffn\.shared_experts\.w[123]\.weight$|(^|\.)(e_proj|h_proj)\.weight$")
_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def storage_of(name: str) -> Storage:
    """How the released format stores the model tensor ``name`` (the table in the module docstring)."""
    if _FP4.search(name):
        return "fp4"
    if _FP8.search(name):
        return "fp8"
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("attn_sink", "ape") or leaf.startswith("hc_") or name.endswith("ffn.gate.bias"):
        return "fp32"
    if leaf == "tid2eid":
        return "index"
    return "bf16"


def scale_name(name: str) -> str:
    """``<module>.weight`` -> ``<module>.scale``: the released name of a quantised weight's scales."""
    return name[: -len(".weight")] + ".scale"


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """[out, in] -> [ceil(out/128), ceil(in/128)]: one scale per 128x128 block (partial blocks at the edges)."""
    out, inp = shape
    return (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))


def fp4_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """[out, in] -> (packed codes [out, in/2], scales [out, in/32]).

    Raises:
        ValueError: ``in`` is not a multiple of 32 (the released format has no partial FP4 block).
    """
    out, inp = shape
    if inp % FP4_BLOCK:
        raise ValueError(f"an FP4 weight needs an input width divisible by {FP4_BLOCK}, got shape {list(shape)}")
    return (out, inp // 2), (out, inp // FP4_BLOCK)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes (float8_e8m0fnu or uint8) -> float32 ``2^(byte - 127)``; byte 255 -> NaN."""
    bits = scale.view(torch.uint8).to(torch.int32)
    out = torch.ldexp(torch.ones_like(bits, dtype=torch.float32), bits - 127)
    return torch.where(bits == 255, torch.full_like(out, float("nan")), out)


def _power_of_two_scale(amax: torch.Tensor, code_max: float) -> torch.Tensor:
    """Smallest 2^k (as its e8m0 byte, uint8) with amax / 2^k <= code_max; amax 0 -> 2^0."""
    ratio = (amax.to(torch.float64) / code_max).clamp_min(2.0 ** -127)
    _, exp = torch.frexp(ratio)  # ratio = m * 2^exp, m in [0.5, 1)
    k = torch.where(ratio == torch.ldexp(torch.full_like(ratio, 0.5), exp), exp - 1, exp)  # exact powers of 2
    k = torch.where(amax == 0, torch.zeros_like(k), k)
    return (k + 127).clamp(0, 254).to(torch.uint8)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 [out, in] with ue8m0 block scales [ceil(out/128), ceil(in/128)] -> float32 [out, in], exact."""
    out, inp = weight.shape
    s = e8m0_to_float(scale).repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
    return weight.to(torch.float32) * s


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu scales [ceil(out/128), ceil(in/128)]).

    Per 128x128 block: scale = smallest power of two with amax / scale <= 448; codes are
    ``weight / scale`` rounded to nearest e4m3 (ties to even, torch's cast).
    """
    w = weight.detach().to(torch.float32)
    out, inp = w.shape
    bo, bi = fp8_scale_shape((out, inp))
    padded = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK, dtype=torch.float32)
    padded[:out, :inp] = w.abs()
    amax = padded.view(bo, FP8_BLOCK, bi, FP8_BLOCK).amax(dim=(1, 3))  # [bo, bi]
    bits = _power_of_two_scale(amax, E4M3_MAX)
    s = e8m0_to_float(bits).repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
    return (w / s).to(torch.float8_e4m3fn), bits.view(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 codes int8 [out, in/2] (low nibble = even column) with ue8m0 scales [out, in/32]
    -> float32 [out, in], exact."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)  # [out, in]
    return table[codes] * e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, 1)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (int8 [out, in/2] packed e2m1 codes, float8_e8m0fnu scales [out, in/32]).

    Per 32 consecutive inputs of a row: scale = smallest power of two with amax / scale <= 6;
    codes round ``weight / scale`` to the nearest e2m1 value, ties to the even code.

    Raises:
        ValueError: ``in`` is not a multiple of 32.
    """
    w = weight.detach().to(torch.float32)
    out, inp = w.shape
    fp4_shapes((out, inp))
    amax = w.abs().view(out, inp // FP4_BLOCK, FP4_BLOCK).amax(-1)  # [out, in/32]
    bits = _power_of_two_scale(amax, E2M1_MAX)
    x = w / e8m0_to_float(bits).repeat_interleave(FP4_BLOCK, 1)
    mag = x.abs().clamp_max(E2M1_MAX)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mids = (values[1:] + values[:-1]) / 2
    low, high = torch.bucketize(mag, mids, right=False), torch.bucketize(mag, mids, right=True)
    code = torch.where((low != high) & (low % 2 == 1), high, low)  # a tie goes to the even code
    code = code + 8 * ((x < 0) & (code != 0)).to(code.dtype)  # no negative zero
    pairs = code.view(out, inp // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8), bits.view(torch.float8_e8m0fnu)
