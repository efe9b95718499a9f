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
    fp8_dispatch: bool = Field(False, description="Under an FP8 recipe with parallel.ep > 1 (opt-in: checked on gloo against the one-process FP8 MLP, not yet run on GPUs or NCCL): the rows into the routed experts cross the EP all-to-all as e4m3 with one float32 scale per row (dim + 4 bytes instead of 2 x dim), in the forward's dispatch and the backward's output-gradient exchange; the experts' outputs and input gradients return in bf16. The experts' weight gradients then use those e4m3 values of their inputs and output gradients (DeepSeek-V3's FP8 framework, report §3.3); false sends bf16 rows and keeps those operands bf16. No effect without FP8 experts or EP.")
    keep_fp32_params: bool = Field(True, description="Keep ape, attn_sink, mHC parameters and router bias in FP32 storage.")
    params_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Storage of the GEMM weight matrices FSDP does not shard (the routed experts; every matrix without parallel.distributed_optimizer): bf16 keeps them as bf16 with their gradients in bf16 and the optimizer's exact fp32 master (Megatron's params_dtype, precision-aware optimizer). FSDP-sharded parameters and the FP32-pinned ones (norms, mHC, ape, sinks, embedding) stay fp32.")
    store_param_remainders: bool = Field(True, description="With params_dtype bf16: keep the fp32 master weight as the 16 low bits beside the bf16 weight (2 B per parameter, exact; Megatron's store_param_remainders) instead of a whole fp32 copy (4 B).")
    exp_avg_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Storage of Muon's momentum and AdamW's first moment (Megatron's exp_avg_dtype); the update is computed in fp32, the state rounded to nearest even.")
    exp_avg_sq_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Storage of AdamW's second moment (Megatron's exp_avg_sq_dtype); the update is computed in fp32, the state rounded to nearest even.")
    policy: ComponentPolicy = Field(default_factory=ComponentPolicy, description="Per-component precision pins.")
