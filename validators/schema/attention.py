"""``attention:`` section: indexer-loss and kernel settings shared by all phases.

The phase itself (dense / warmup / sparse) is set per curriculum stage
(``curriculum.stages[i].phase``); see seed 000 §2 for what each phase builds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section
from .limits import MAX_SEQ_LEN

KernelBackend = Literal["reference", "triton", "cudnn"]
"""reference: plain PyTorch, any device. triton: this project's fused Triton kernels (SM90+).
cudnn: FlashMLA sparse forward + cuDNN-frontend DSA kernels (SM90+, installed separately)."""

FUSED_BACKENDS: frozenset[str] = frozenset({"triton", "cudnn"})
"""Backends that run fused GPU kernels and therefore need SM90 or newer."""

IndexerLoss = Literal["dense", "sparse"]
"""dense: KL target over every visible compressed entry; sparse: over the top-k selected set."""


class AttentionConfig(Section):
    """Indexer loss and attention-kernel settings (Megatron: dsa_indexer_loss_coeff, dsa_kernel_backend)."""

    indexer_loss_coeff: float = Field(1e-2, ge=0, le=1e3, description="Weight of the indexer KL loss (dsa_indexer_loss_coeff). Must be > 0 in warmup/sparse phases or the indexer never trains.")
    kernel_backend: KernelBackend = Field("reference", description="Attention kernels: reference (any device), triton or cudnn (fused, SM90+).")
    kl_chunk_size: int = Field(1024, ge=1, le=MAX_SEQ_LEN, description="Queries per chunk when building the indexer KL target (bounds memory; never a dense [B,H,S,P] tensor).")
    indexer_qat: bool = Field(False, description="Explicit opt-in to low-precision (FP8/FP4) indexer QK; off keeps the indexer QK in BF16 (seed 004 item 4).")
