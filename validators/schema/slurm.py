"""``slurm:`` section: cluster profile used by ``v4launch submit`` (rendered to sbatch via submitit)."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class SlurmConfig(Section):
    """Slurm job settings. Every value is quoted when rendered into sbatch."""

    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    qos: str | None = Field(None, description="sbatch --qos.")
    time_min: int = Field(240, ge=1, description="Wall-time limit per job (minutes).")
    cpus_per_task: int = Field(8, ge=1, description="CPU cores per task (one task per GPU).")
    mem_gb: int | None = Field(None, ge=1, description="Memory per node (GB); null = cluster default.")
    container_image: str | None = Field(None, description="Container image (pyxis --container-image).")
    container_mounts: tuple[str, ...] = Field((), description="Container mounts 'src:dst'.")
    signal_delay_s: int = Field(120, ge=10, description="Seconds before the time limit at which the job is signalled to checkpoint.")
    max_restarts: int = Field(5, ge=0, description="Restart budget (preemptions, time limits, crashes) before the run is stopped.")
    master_port: int = Field(29500, ge=1024, le=65535, description="Rendezvous TCP port on the first node.")
    setup: tuple[str, ...] = Field((), description="Shell lines run before the job (module loads, env).")
    additional_parameters: dict[str, str] = Field(default_factory=dict, description="Extra sbatch parameters passed to submitit (name → value).")
