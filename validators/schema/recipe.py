"""The whole recipe: one pydantic model composed of one model per YAML section."""

from __future__ import annotations

from pydantic import Field, model_validator

from .attention import AttentionConfig
from .base import Section
from .limits import MAX_NAME_CHARS, MAX_TEXT_CHARS
from .cluster import ClusterConfig
from .curriculum import CurriculumConfig, Stage
from .model import ModelConfig
from .parallel import ParallelConfig
from .precision import PrecisionConfig
from .slurm import SlurmConfig
from .training import CheckpointConfig, CompileConfig, DataConfig, LoggingConfig, OptimizerConfig, RunConfig


class Recipe(Section):
    """A complete V4 training run. Sections mirror the YAML top-level keys."""

    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9_.-]+$", description="Recipe name (letters, digits, _ . -).")
    description: str = Field("", max_length=MAX_TEXT_CHARS, description="Free text.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Architecture.")
    attention: AttentionConfig = Field(default_factory=AttentionConfig, description="Indexer loss and kernels.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Parallel sizes and batch.")
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="Precision policy.")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="Regional torch.compile.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Target hardware.")
    curriculum: CurriculumConfig = Field(..., description="Ordered stages.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and LR schedule.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training data.")
    checkpointing: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and display.")
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and reproducibility.")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="Slurm profile for submit.")

    @model_validator(mode="after")
    def _stage_lr_above_min_lr(self) -> "Recipe":
        low = [(i, s.lr) for i, s in enumerate(self.curriculum.stages) if s.lr is not None and s.lr < self.optimizer.min_lr]
        if low:
            i, lr = low[0]
            raise ValueError(f"curriculum.stages.{i}.lr = {lr:g} is below optimizer.min_lr = {self.optimizer.min_lr:g}: "
                             f"the schedule decays from a stage's peak down to min_lr; set curriculum.stages.{i}.lr >= "
                             f"{self.optimizer.min_lr:g} or lower optimizer.min_lr")
        return self

    def stage_cp(self, stage: Stage) -> int:
        """CP size of ``stage`` (its override, else parallel.cp)."""
        return stage.cp if stage.cp is not None else self.parallel.cp

    def stage_global_batch(self, stage: Stage) -> int:
        """Global batch (packed sequences) of ``stage``."""
        return stage.global_batch_size or self.parallel.global_batch_size

    def stage_dp(self, stage: Stage) -> int | None:
        """Data-parallel size of ``stage`` = world / (tp·pp·cp); None if it does not divide."""
        denom = self.parallel.tp * self.parallel.pp * self.stage_cp(stage)
        world = self.cluster.world_size
        return world // denom if world % denom == 0 else None
