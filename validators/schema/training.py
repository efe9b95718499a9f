"""``optimizer:``, ``data:``, ``checkpointing:``, ``logging:`` and ``run:`` sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class OptimizerConfig(Section):
    """Muon for matrices, AdamW for embeddings, head, norms, biases and mHC gates (paper §training)."""

    name: Literal["muon_adamw", "adamw"] = Field("muon_adamw", description="muon_adamw: Muon for 2-D hidden weights + AdamW for the rest; adamw: AdamW everywhere.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate (AdamW groups; Muon groups use muon_lr).")
    muon_lr: float = Field(2e-2, gt=0, description="Peak learning rate of Muon parameter groups.")
    min_lr: float = Field(3e-5, ge=0, description="Final learning rate of the decay.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay (matrices only).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon momentum.")
    warmup_steps: int = Field(100, ge=0, description="Linear LR warm-up (optimizer steps) at the start of the run.")
    schedule: Literal["cosine", "constant", "wsd"] = Field("cosine", description="LR decay shape over the whole curriculum.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: fraction of total steps spent decaying.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables.")


class DataConfig(Section):
    """Training text → megatron-core indexed dataset (.bin/.idx) → packed THD micro-batches."""

    source: Literal["python_stdlib", "files"] = Field("python_stdlib", description="python_stdlib: the interpreter's own standard-library sources (on every machine); files: 'paths'.")
    paths: tuple[str, ...] = Field((), description="Text (.txt, any plain file) or .jsonl files / directories when source=files.")
    jsonl_key: str = Field("text", description="Field holding the document text in .jsonl inputs.")
    tokenizer: Literal["byte"] = Field("byte", description="byte: UTF-8 bytes + end-of-document token (vocab 257+).")
    prefix: str | None = Field(None, description="Path prefix of a prepared indexed dataset; null = prepare into the workspace cache.")
    max_documents: int | None = Field(None, ge=1, description="Cap on documents taken from the source.")
    validation_fraction: float = Field(0.02, ge=0, lt=1, description="Share of documents held out for evaluation.")
    seed: int = Field(1234, description="Seed of the document order.")


class CheckpointConfig(Section):
    """torch.distributed.checkpoint saves with a manifest; atomic (written aside, renamed into place)."""

    interval_steps: int = Field(100, ge=1, description="Save every N optimizer steps (and at each stage end).")
    keep_last: int = Field(3, ge=1, description="Complete checkpoints kept; older ones are deleted after a successful save.")


class LoggingConfig(Section):
    """Metrics to JSONL (always), TensorBoard (optional) and the rich console."""

    interval_steps: int = Field(1, ge=1, description="Log every N optimizer steps.")
    tensorboard: bool = Field(True, description="Also write TensorBoard event files.")
    eval_interval_steps: int = Field(0, ge=0, description="Evaluate held-out loss every N steps; 0 = only at stage end.")


class RunConfig(Section):
    """Run identity and reproducibility."""

    output_root: str = Field("runs", description="Directory (relative to the workspace) holding run directories.")
    seed: int = Field(0, description="Seed of parameter init and any sampling.")
    deterministic: bool = Field(True, description="Deterministic algorithms (bitwise-reproducible resume on CPU).")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads per rank; null = torch default.")
