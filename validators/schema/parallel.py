"""``parallel:`` section: TP/PP/VPP/CP/EP/DP, batch sizes, recompute and offload.

Field names follow Megatron-LM where one exists (reference/megatron-v4-contract.md §2).
CP may be overridden per curriculum stage; ``cp`` here is the default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section
from .limits import MAX_DEGREE, MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_TEXT_CHARS

RecomputeModule = Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]
"""Megatron-LM's selective-recompute module names (``--recompute-modules``, transformer_config.py)."""

OffloadModule = Literal["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]
"""Megatron-LM's fine-grained activation-offload module names (``offload_modules``, transformer_config.py)."""


class ParallelConfig(Section):
    """Parallel sizes and batch geometry. DP is derived: world / (tp · pp · cp)."""

    tp: int = Field(1, ge=1, le=MAX_DEGREE, description="Tensor-parallel size (V4 hybrid attention supports only 1).")
    pp: int = Field(1, ge=1, le=MAX_DEGREE, description="Pipeline-parallel size.")
    vpp: int = Field(1, ge=1, le=MAX_DEGREE, description="Virtual pipeline stages per PP rank.")
    pp_layout: str | None = Field(None, max_length=MAX_TEXT_CHARS, description="Megatron pipeline layout string, e.g. 'Et*10|t*12|t*12|t*9mL'; required when pp*vpp > 1.")
    cp: int = Field(1, ge=1, le=MAX_DEGREE, description="Default context-parallel size (stages may override).")
    cp_partition: Literal["contiguous", "zigzag"] = Field("contiguous", description="CP token partition; V4 needs contiguous.")
    qkv_format: Literal["thd", "bshd"] = Field("thd", description="thd: packed variable-length (cu_seqlens); bshd: padded batch.")
    ep: int = Field(1, ge=1, le=MAX_DEGREE, description="Expert-parallel size (folded over DP x CP).")
    micro_batch_size: int = Field(1, ge=1, le=MAX_MICRO_BATCH, description="Packed sequences per micro-batch per rank (THD uses 1); at most 64 (64 x 2^24 tokens stays below int32's 2^31).")
    global_batch_size: int = Field(1, ge=1, le=MAX_GLOBAL_BATCH, description="Packed sequences per optimizer step, all ranks together; at most 2^24 (~1000x the largest published batches).")
    distributed_optimizer: bool = Field(False, description="Shard optimizer state over DP (Megatron distributed optimizer).")
    recompute_granularity: Literal["none", "selective", "full"] = Field("none", description="Activation recompute: none; selective (the recompute_modules); full (every decoder and MTP layer whole: it keeps its input streams only, and backward re-runs one layer at a time; at cp > 1 or ep > 1 it replays their collectives, V4-RECOMPUTE-REPLAY).")
    recompute_modules: tuple[RecomputeModule, ...] = Field((), description="Modules recomputed under selective recompute (Megatron's names: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts), e.g. ['mla_up_proj']; 'core_attn' is not supported by V4.")
    cpu_offloading: bool = Field(False, description="Move the input streams each decoder and MTP layer keeps under whole-layer recompute to pinned host memory during forward, on a side stream, and back ahead of its backward (Megatron's cpu_offloading); needs recompute_granularity=full.")
    offload_modules: tuple[OffloadModule, ...] = Field((), description="Activation offload modules (Megatron's names: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act); 'qkv_linear' is not supported by V4.")
