"""``precision:`` section: compute dtype, FP8 recipe and the per-component policy (seed 000 §9, seed 004 items 4, 6f, 9)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section

LowPrecision = Literal["fp8", "fp4"]


class ComponentPolicy(Section):
    """Precision of the components the V4 contract pins (seed 000 §9 table)."""

    compressor_gemm: Literal["bf16", "fp8"] = Field("bf16", description="Main and indexer compressor wkv/wgate GEMMs; must stay BF16 under FP8.")
    indexer_weights_proj: Literal["bf16", "fp8"] = Field("bf16", description="Indexer head-weight projection; must stay BF16 under FP8.")
    indexer_qk: Literal["bf16", "fp8", "fp4"] = Field("bf16", description="Indexer QK product; low precision only with attention.indexer_qat.")
    ape: Literal["fp32", "bf16"] = Field("fp32", description="Compressor positional bias parameter; FP32.")
    attn_sink: Literal["fp32", "bf16"] = Field("fp32", description="Attention sink parameter; FP32.")


class PrecisionConfig(Section):
    """Parameter/compute dtype and low-precision recipe."""

    dtype: Literal["fp32", "bf16"] = Field("bf16", description="Model compute dtype (bf16 autocast where the device supports it).")
    fp8_recipe: Literal["none", "delayed", "blockwise", "mxfp8"] = Field("none", description="FP8 training recipe for eligible GEMMs; none = BF16 only.")
    keep_fp32_params: bool = Field(True, description="Keep ape, attn_sink, mHC parameters and router bias in FP32 storage.")
    policy: ComponentPolicy = Field(default_factory=ComponentPolicy, description="Per-component precision pins.")
