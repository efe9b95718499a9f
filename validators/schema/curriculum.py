"""``curriculum:`` section: ordered stages (sequence length, CP, attention phase, budget, LR).

The 64K → 1M context curriculum and the dense → sparse-warm-up → sparse phase
changes (seed 000 §2; paper: sparse attention introduced at 64K with a short
indexer warm-up) are both expressed as stages. Rules run once per stage.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .attention import IndexerLoss, KernelBackend
from .base import Section
from .limits import MAX_DEGREE, MAX_GLOBAL_BATCH, MAX_LIST_ITEMS, MAX_NAME_CHARS, MAX_SEQ_LEN, MAX_STEPS, MAX_TOKENS

Phase = Literal["dense", "warmup", "sparse"]
"""dense: no indexer, every visible compressed entry attended. warmup: indexer built, sparse main
output, dense KL teacher. sparse: top-k main output, KL teacher over the selected set."""

PHASE_ORDER: dict[str, int] = {"dense": 0, "warmup": 1, "sparse": 2}
"""Phases only move forward along this order."""

DEFAULT_INDEXER_LOSS: dict[str, IndexerLoss | None] = {"dense": None, "warmup": "dense", "sparse": "sparse"}
"""Indexer-loss target each phase uses unless a stage overrides it."""


class Stage(Section):
    """One curriculum stage. Exactly one of ``tokens`` / ``steps`` sets its budget."""

    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9_.-]+$", description="Stage name (letters, digits, _ . -); used in run directories and logs.")
    seq_len: int = Field(..., ge=1, le=MAX_SEQ_LEN, description="Packed tokens per micro-batch sequence (THD capacity); at most 2^24 = 16,777,216 (16x the released 1M context; keeps int32 token positions of the attention kernels in range).")
    cp: int | None = Field(None, ge=1, le=MAX_DEGREE, description="Context-parallel size for this stage; null = parallel.cp.")
    phase: Phase = Field("sparse", description="Attention phase: dense, warmup or sparse.")
    indexer_loss: IndexerLoss | None = Field(None, description="KL target override; null = the phase default (warmup: dense, sparse: sparse).")
    kernel_backend: KernelBackend | None = Field(None, description="Attention kernels for this stage; null = attention.kernel_backend (e.g. 'reference' for one stage of a triton recipe).")
    tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Budget in training tokens (global, all ranks); at most 2^50 (~1.1e15, 30x the largest published corpus).")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Budget in optimizer steps; at most 2^31 - 1.")
    lr: float | None = Field(None, gt=0, le=1, description="Peak learning rate of this stage, in (0, 1] and >= optimizer.min_lr; null = optimizer.lr.")
    global_batch_size: int | None = Field(None, ge=1, le=MAX_GLOBAL_BATCH, description="Global batch (packed sequences) override for this stage; at most 2^24.")

    @model_validator(mode="after")
    def _one_budget(self) -> "Stage":
        if (self.tokens is None) == (self.steps is None):
            raise ValueError(
                f"stage '{self.name}': set exactly one of 'tokens' or 'steps' as its budget "
                f"(got tokens={self.tokens}, steps={self.steps})"
            )
        return self

    @property
    def effective_indexer_loss(self) -> IndexerLoss | None:
        """The KL target this stage trains with (None in dense mode: no indexer)."""
        if self.phase == "dense":
            return None
        return self.indexer_loss or DEFAULT_INDEXER_LOSS[self.phase]


class CurriculumConfig(Section):
    """Ordered stages; a stage starts from the previous stage's final checkpoint."""

    stages: tuple[Stage, ...] = Field(..., min_length=1, max_length=MAX_LIST_ITEMS, description="Stages in run order.")

    @model_validator(mode="after")
    def _unique_names(self) -> "CurriculumConfig":
        names = [s.name for s in self.stages]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"curriculum.stages: stage names must be unique; repeated: {', '.join(dup)}")
        return self
