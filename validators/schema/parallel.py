"""``parallel:`` section: TP/PP/VPP/CP/EP/DP, batch sizes, recompute and offload.

Field names follow Megatron-LM where one exists (reference/megatron-v4-contract.md §2).
CP may be overridden per curriculum stage; ``cp`` here is the default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class ParallelConfig(Section):
    """Parallel sizes and batch geometry. DP is derived: world / (tp · pp · cp)."""

    tp: int = Field(1, ge=1, description="Tensor-parallel size (V4 hybrid attention supports only 1).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel size.")
    vpp: int = Field(1, ge=1, description="Virtual pipeline stages per PP rank.")
    pp_layout: str | None = Field(None, description="Megatron pipeline layout string, e.g. 'Et*10|t*12|t*12|t*9mL'; required when pp*vpp > 1.")
    cp: int = Field(1, ge=1, description="Default context-parallel size (stages may override).")
    cp_partition: Literal["contiguous", "zigzag"] = Field("contiguous", description="CP token partition; V4 needs contiguous.")
    qkv_format: Literal["thd", "bshd"] = Field("thd", description="thd: packed variable-length (cu_seqlens); bshd: padded batch.")
    ep: int = Field(1, ge=1, description="Expert-parallel size (folded over DP x CP).")
    micro_batch_size: int = Field(1, ge=1, description="Packed sequences per micro-batch per rank (THD uses 1).")
    global_batch_size: int = Field(1, ge=1, description="Packed sequences per optimizer step, all ranks together.")
    distributed_optimizer: bool = Field(False, description="Shard optimizer state over DP (Megatron distributed optimizer).")
    recompute_granularity: Literal["none", "selective", "full"] = Field("none", description="Activation recompute granularity.")
    recompute_modules: tuple[str, ...] = Field((), description="Modules recomputed under selective recompute, e.g. ['mla_up_proj']; 'core_attn' is not supported by V4.")
    offload_modules: tuple[str, ...] = Field((), description="Activation offload modules; 'qkv_linear' is not supported by V4.")
