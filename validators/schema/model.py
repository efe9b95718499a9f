"""``model:`` section: the V4 architecture (released DeepSeek-V4 config fields).

Defaults are V4-Flash as released (reference/v4-model-spec.md §1): the Flash
``config.json`` carries ``compress_rope_theta = 160000`` (not the 40000 default of
the inference ``ModelArgs`` dataclass). Field names follow the released config so a
reader can diff a recipe against ``config.json``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, computed_field, field_validator, model_validator

from .base import Section
from .limits import (
    MAX_EXPERTS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_MTP_DEPTH,
    MAX_ROPE_THETA,
    MAX_SEQ_LEN,
    MAX_SHARED_EXPERTS,
    MAX_TEXT_CHARS,
    MAX_VOCAB,
    MAX_WIDTH,
)

CompressRatio = Literal[0, 4, 128]
"""0 = sliding-window only (SWA), 4 = CSA (overlapping compressor + lightning indexer), 128 = HCA."""

FLASH_COMPRESS_RATIOS: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
"""Released V4-Flash schedule: 43 decoder layers (2 SWA, 21 CSA, 20 HCA) + the MTP slot (0)."""

PRO_COMPRESS_RATIOS: tuple[int, ...] = (128, 128) + (4, 128) * 29 + (4, 0)
"""Released V4-Pro schedule: 61 decoder layers (31 HCA, 30 CSA) + the MTP slot (0)."""

RELEASED_COMPRESS_ROPE_THETA = 160000.0
"""compress_rope_theta of every released V4 config (spec §4 item 1)."""


class YarnConfig(Section):
    """YaRN frequency interpolation for compressed (CSA/HCA) layers; no mscale anywhere (spec §1)."""

    factor: float = Field(16.0, gt=0, le=1 << 20, description="rope_scaling.factor: context extension factor.")
    original_seq_len: int = Field(65536, ge=0, le=MAX_SEQ_LEN, description="rope_scaling.original_max_position_embeddings (tokens); 0 disables YaRN.")
    beta_fast: float = Field(32.0, gt=0, le=1e4, description="YaRN beta_fast: high-frequency end of the correction ramp.")
    beta_slow: float = Field(1.0, gt=0, le=1e4, description="YaRN beta_slow: low-frequency end of the correction ramp.")


class RopeConfig(Section):
    """RoPE per layer type: ratio-0 layers use ``rope_theta`` without YaRN; compressed layers use ``compress_rope_theta`` with YaRN."""

    rope_theta: float = Field(10000.0, gt=0, le=MAX_ROPE_THETA, description="RoPE base of SWA (ratio-0) and MTP layers.")
    compress_rope_theta: float = Field(RELEASED_COMPRESS_ROPE_THETA, gt=0, le=MAX_ROPE_THETA, description="RoPE base of CSA/HCA layers (released: 160000).")
    yarn: YarnConfig = Field(default_factory=YarnConfig, description="YaRN frequency interpolation of compressed layers.")
    softmax_scale: float | None = Field(None, gt=0, le=1, description="Attention softmax scale; null means head_dim**-0.5. A value that folds in the YaRN mscale is a contract violation (seed 004 item 1).")


class IndexerConfig(Section):
    """Lightning indexer of CSA layers (spec §2 "Indexer")."""

    n_heads: int = Field(64, ge=1, le=MAX_HEADS, description="index_n_heads.")
    head_dim: int = Field(128, ge=2, le=MAX_HEAD_DIM, description="index_head_dim (channels); the last rope_head_dim of them carry RoPE.")
    topk: int = Field(512, ge=1, le=MAX_SEQ_LEN, description="index_topk: compressed entries each query selects.")
    hadamard: bool = Field(True, description="Rotate indexer q and k by a normalised Hadamard matrix before scoring.")


class MoEConfig(Section):
    """Routed + shared experts with sqrtsoftplus routing (spec §3)."""

    n_routed_experts: int = Field(256, ge=1, le=MAX_EXPERTS, description="Routed experts per MoE layer; at most 2^14 (~40x the largest released MoE).")
    n_activated_experts: int = Field(6, ge=1, le=MAX_EXPERTS, description="Experts each token is routed to (top-k).")
    n_shared_experts: int = Field(1, ge=0, le=MAX_SHARED_EXPERTS, description="Always-on shared experts.")
    moe_inter_dim: int = Field(2048, ge=1, le=MAX_WIDTH, description="Expert (and shared expert) SwiGLU hidden width.")
    route_scale: float = Field(1.5, gt=0, le=1e3, description="routed_scaling_factor applied to normalised routing weights.")
    n_hash_layers: int = Field(3, ge=0, le=MAX_LAYERS, description="First layers routed by a fixed token-id → expert table (tid2eid) instead of the learned gate.")
    swiglu_limit: float = Field(10.0, gt=0, le=1e6, description="SwiGLU clamp: silu(min(w1x, L)) * clamp(w3x, ±L).")
    balance_loss_alpha: float = Field(1e-4, ge=0, le=1, description="Sequence-wise balance loss coefficient alpha (V3 formula).")
    bias_update_speed: float = Field(1e-3, ge=0, le=1, description="Aux-loss-free router bias update speed gamma, per step.")

    @model_validator(mode="after")
    def _activated_within_routed(self) -> "MoEConfig":
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(f"model.moe.n_activated_experts = {self.n_activated_experts} is more than the "
                             f"{self.n_routed_experts} routed experts a token can choose from; set "
                             f"model.moe.n_activated_experts <= {self.n_routed_experts}")
        return self


class MHCConfig(Section):
    """Manifold-constrained hyper-connections: residual streams mixed by Sinkhorn-normalised matrices (spec §3)."""

    hc_mult: int = Field(4, ge=1, le=64, description="Residual streams.")
    sinkhorn_iters: int = Field(20, ge=1, le=10_000, description="hc_sinkhorn_iters.")
    eps: float = Field(1e-6, gt=0, le=1, description="hc_eps.")


class MTPConfig(Section):
    """Multi-token prediction (spec §3 "MTP")."""

    depth: int = Field(1, ge=0, le=MAX_MTP_DEPTH, description="MTP layers (num_nextn_predict_layers); each takes one compress_ratios slot after the decoder layers.")
    loss_weight: float = Field(0.3, ge=0, le=1e3, description="MTP loss weight (paper: 0.3, then 0.1 once LR decay starts).")
    loss_weight_after_decay: float = Field(0.1, ge=0, le=1e3, description="MTP loss weight once the LR schedule starts decaying.")


class ModelConfig(Section):
    """The V4 architecture. Defaults: V4-Flash as released."""

    vocab_size: int = Field(129280, ge=2, le=MAX_VOCAB, description="Vocabulary size (tokens).")
    dim: int = Field(4096, ge=1, le=MAX_WIDTH, description="Hidden size.")
    n_layers: int = Field(43, ge=1, le=MAX_LAYERS, description="Decoder layers (num_hidden_layers), MTP excluded.")
    compress_ratios: tuple[CompressRatio, ...] = Field(FLASH_COMPRESS_RATIOS, max_length=MAX_LAYERS + MAX_MTP_DEPTH, description="Per layer: 0 SWA, 4 CSA, 128 HCA; n_layers entries then one per MTP layer.")
    n_heads: int = Field(64, ge=1, le=MAX_HEADS, description="Attention heads.")
    head_dim: int = Field(512, ge=2, le=MAX_HEAD_DIM, description="Head dim of q and of the shared KV latent (K = V).")
    rope_head_dim: int = Field(64, ge=2, le=MAX_HEAD_DIM, description="Trailing dims of each head that carry RoPE.")
    q_lora_rank: int = Field(1024, ge=1, le=MAX_WIDTH, description="Low-rank query dim (wq_a output).")
    o_groups: int = Field(8, ge=1, le=MAX_HEADS, description="Output-projection groups (wo_a is per group).")
    o_lora_rank: int = Field(1024, ge=1, le=MAX_WIDTH, description="Per-group low-rank output dim.")
    window_size: int = Field(128, ge=1, le=MAX_SEQ_LEN, description="Sliding window (tokens, including the query itself).")
    norm_eps: float = Field(1e-6, gt=0, le=1, description="RMSNorm epsilon.")
    max_position_embeddings: int = Field(1048576, ge=1, le=MAX_SEQ_LEN, description="Longest sequence the model is configured for (tokens); at most 2^24 like a stage's seq_len.")
    init_std: float = Field(0.02, gt=0, le=1, description="Std of the normal init of projection weights.")
    init_from_released: Literal[False] | Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)] = Field(False, description="false: start from a fresh initialisation; a path: start from the released weights imported there by `v4launch checkpoint import` (then released constants such as compress_rope_theta are checked).")
    rope: RopeConfig = Field(default_factory=RopeConfig, description="RoPE/YaRN per layer type.")
    indexer: IndexerConfig = Field(default_factory=IndexerConfig, description="Lightning indexer of CSA layers.")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="Mixture of experts.")
    mhc: MHCConfig = Field(default_factory=MHCConfig, description="mHC residual streams.")
    mtp: MTPConfig = Field(default_factory=MTPConfig, description="Multi-token prediction.")

    @field_validator("init_from_released", mode="before")
    @classmethod
    def _released_path(cls, value: object) -> object:
        if value is True:
            raise ValueError("model.init_from_released takes the directory `v4launch checkpoint import` wrote "
                             "(e.g. imported/flash), or false for a fresh start; true names no weights")
        return value

    @computed_field  # type: ignore[prop-decorator]
    @property
    def decoder_ratios(self) -> tuple[int, ...]:
        """compress_ratios of the decoder layers only (MTP slots dropped)."""
        return tuple(self.compress_ratios[: self.n_layers])

    @computed_field  # type: ignore[prop-decorator]
    @property
    def has_csa(self) -> bool:
        """True if any layer (decoder or MTP) has ratio 4."""
        return 4 in self.compress_ratios

    @computed_field  # type: ignore[prop-decorator]
    @property
    def has_hca(self) -> bool:
        """True if any layer (decoder or MTP) has ratio 128."""
        return 128 in self.compress_ratios
