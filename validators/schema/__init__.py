"""Pydantic v2 schema of a v4launch recipe: one module per YAML section. Never imports torch."""

from .attention import FUSED_BACKENDS, AttentionConfig, IndexerLoss, KernelBackend
from .cluster import GPU_MEMORY_GIB, GPU_SM, ClusterConfig
from .curriculum import DEFAULT_INDEXER_LOSS, PHASE_ORDER, CurriculumConfig, Phase, Stage
from .model import (
    FLASH_COMPRESS_RATIOS,
    PRO_COMPRESS_RATIOS,
    RELEASED_COMPRESS_ROPE_THETA,
    IndexerConfig,
    MHCConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RopeConfig,
    YarnConfig,
)
from .parallel import ParallelConfig
from .precision import ComponentPolicy, PrecisionConfig
from .recipe import Recipe
from .slurm import SlurmConfig
from .training import CheckpointConfig, DataConfig, LoggingConfig, OptimizerConfig, RunConfig, WandbConfig

__all__ = [name for name in dir() if not name.startswith("_")]
