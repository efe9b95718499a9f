"""``slurm:`` section: cluster profile used by ``v4launch submit`` (rendered to sbatch via submitit)."""

from __future__ import annotations

from pydantic import Field

from .base import Section
from .limits import MAX_LIST_ITEMS, MAX_NAME_CHARS, MAX_RESTARTS, MAX_TEXT_CHARS


class SlurmConfig(Section):
    """Slurm job settings. Every value is quoted when rendered into sbatch."""

    partition: str | None = Field(None, max_length=MAX_NAME_CHARS, description="sbatch --partition.")
    account: str | None = Field(None, max_length=MAX_NAME_CHARS, description="sbatch --account.")
    qos: str | None = Field(None, max_length=MAX_NAME_CHARS, description="sbatch --qos.")
    time_min: int = Field(240, ge=1, le=525_600, description="Wall-time limit per job (minutes).")
    cpus_per_task: int = Field(8, ge=1, le=4096, description="CPU cores per task (one task per GPU).")
    mem_gb: int | None = Field(None, ge=1, le=1 << 20, description="Memory per node (GB); null = cluster default.")
    container_image: str | None = Field(None, max_length=MAX_TEXT_CHARS, description="Container image (pyxis --container-image).")
    container_mounts: tuple[str, ...] = Field((), max_length=MAX_LIST_ITEMS, description="Container mounts 'src:dst'.")
    signal_delay_s: int = Field(120, ge=10, le=86_400, description="Seconds before the time limit at which the job is signalled to checkpoint.")
    max_restarts: int = Field(5, ge=0, le=MAX_RESTARTS, description="Failure budget: requeues without a checkpoint (node failures, kills) before the run is stopped. A requeue after the time limit or a preemption notice, with its checkpoint saved, is a planned segment and does not count (slurm.max_segments bounds those).")
    max_segments: int | None = Field(None, ge=1, le=MAX_RESTARTS, description="Most Slurm jobs (segments of slurm.time_min, each ended by the time limit or a preemption and requeued from its checkpoint) one curriculum stage may take; the job stops the run at the cap, and validate warns (V4-SLURM-SEGMENTS) when the time plan needs more. null = no cap.")
    master_port: int = Field(29500, ge=1024, le=65535, description="Rendezvous TCP port on the first node.")
    setup: tuple[str, ...] = Field((), max_length=MAX_LIST_ITEMS, description="Shell lines run before the job (module loads, env).")
    additional_parameters: dict[str, str] = Field(default_factory=dict, max_length=MAX_LIST_ITEMS, description="Extra sbatch parameters passed to submitit (name → value).")
