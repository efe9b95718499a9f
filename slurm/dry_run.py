"""``v4launch submit --dry-run``: every stage's Slurm job of a run, written where a person can read it.

A run is a chain of jobs, one per curriculum stage: ``submit`` queues stage 0; when a stage completes,
rank 0 of its job submits the next stage's job (``job.SlurmTrainJob._submit_next_stage``; no Slurm
``--dependency``). Each job runs up to ``slurm.time_min`` minutes, then checkpoints at the signal and
requeues itself (the same job id) until the stage is done. Every job renders the same sbatch script:
the job knows only the run directory and finds its stage and step from the run's checkpoints.

The dry run writes into one folder (nothing under the workspace's runs, nothing queued):

* ``stage<N>-<name>.sbatch``: the exact script of each stage's job (``render.render_sbatch``);
* ``recipe.yaml``: the resolved recipe the run directory will freeze;
* ``chain.json``: the jobs (nodes, time limit, dependency, resume point, steps, estimate), as ``--json``;
* ``AT_SUBMIT.txt``: the files ``submit`` creates that the script refers to and a dry run cannot (job ids).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .job import DEFAULT_ENTRY
from .render import SUBMITIT_DIR, render_sbatch

DRY_RUN_DIR = "dry-run"
"""Folder under the workspace's ``.v4launch/`` holding one folder per dry run (the run's would-be name)."""


@dataclass(frozen=True)
class StageJob:
    """The Slurm job of one curriculum stage.

    Attributes:
        steps: optimizer steps of the stage; first_step: the global step it starts at.
        time_limit_min: ``slurm.time_min`` of each of its Slurm jobs (segments).
        est_wall_h, est_segments: the time plan's estimate (None where there is none: a CPU target).
        dependency, resume: what starts the job and what it starts from, in words.
        script: the file name of its sbatch script in the dry-run folder.
    """

    index: int
    name: str
    phase: str
    seq_len: int
    cp: int
    dp: int
    steps: int
    first_step: int
    nodes: int
    gpus_per_node: int
    time_limit_min: int
    est_wall_h: float | None
    est_segments: int | None
    dependency: str
    resume: str
    script: str


@dataclass(frozen=True)
class DryRun:
    """What ``write_dry_run`` wrote: the folder, the run directory ``submit`` would create now, the jobs."""

    folder: Path
    run_dir: Path
    jobs: tuple[StageJob, ...]
    at_submit: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run_dir": str(self.folder), "run_dir": str(self.run_dir),
                "jobs": [asdict(j) for j in self.jobs], "at_submit": list(self.at_submit),
                "scripts_identical": True}


def _resume(recipe: Any, plan: Any, previous: Any) -> str:
    if previous is not None:
        return f"stage {previous.index} {previous.name}'s last checkpoint (global step {plan.first_step})"
    released = recipe.model.init_from_released
    return f"the released weights imported at {released} (step 0)" if released else "a fresh initialisation (step 0)"


def _jobs(recipe: Any, plans: list[Any]) -> list[StageJob]:
    from ..validators.time_plan import time_plan

    estimate = time_plan(recipe)
    c, s = recipe.cluster, recipe.slurm
    jobs = []
    for plan in plans:
        previous = plans[plan.index - 1] if plan.index else None
        dependency = ("none: queued by this submit" if previous is None else
                      f"queued by stage {previous.index}'s job when that stage completes")
        est = estimate.stages[plan.index] if estimate else None
        jobs.append(StageJob(plan.index, plan.name, plan.phase, plan.seq_len, plan.cp, plan.dp, plan.steps,
                             plan.first_step, c.nodes, c.gpus_per_node, s.time_min,
                             round(est.wall_s / 3600, 2) if est else None, est.segments if est else None,
                             dependency, _resume(recipe, plan, previous),
                             f"stage{plan.index}-{plan.name}.sbatch"))
    return jobs


def _at_submit(run_dir: Path, recipe: Any) -> tuple[str, ...]:
    folder = run_dir / SUBMITIT_DIR
    return (
        f"{run_dir}/run.json, recipe.yaml (this folder's recipe.yaml), code revision (code.diff when the tree is dirty)",
        f"{folder}/<job id>_submitted.pkl: the pickled SlurmTrainJob(run_dir={str(run_dir)!r}, max_steps=None, "
        f"entry={DEFAULT_ENTRY!r}) that `python -m submitit.core._submit {folder}` loads on every task",
        f"{folder}/<job id>_<task>_log.out: the job's logs (sbatch --output, srun --output)",
        f"{run_dir}/ledger.jsonl: every submit, requeue and stage end (`v4launch status`)",
        f"checkpoints every {recipe.checkpointing.interval_steps} steps and at each stage end: what a requeued or "
        "next-stage job resumes from",
    )


def write_dry_run(loaded: Any, plans: list[Any], run_dir: Path, folder: Path) -> DryRun:
    """Render every stage's job of ``loaded`` for the run directory ``run_dir`` and write them into ``folder``.

    Args:
        loaded: the loaded recipe (``.recipe``, ``.to_yaml()``).
        plans: the job's plan of every stage (``training.plan.plan_curriculum``: index, name, phase, seq_len, cp,
            dp, steps, first_step).
        run_dir: the run directory ``submit`` would create now (``submit.predicted_run_dir``).
        folder: where to write; created if missing.

    Raises:
        UsageError: ``folder`` is a file, or holds files other than a dry run's.
        RecipeError: a value that cannot be put into an sbatch script safely (``render_sbatch``).
    """
    recipe = loaded.recipe
    script = render_sbatch(recipe, run_dir, job_name=run_dir.name)
    jobs = _jobs(recipe, plans)
    _check_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.sbatch"):  # an earlier dry run's, perhaps of more stages
        stale.unlink()
    for job in jobs:
        (folder / job.script).write_text(script)
    (folder / "recipe.yaml").write_text(loaded.to_yaml())
    dry = DryRun(folder.absolute(), run_dir, tuple(jobs), _at_submit(run_dir, recipe))
    (folder / "chain.json").write_text(json.dumps(dry.to_dict(), indent=2) + "\n")
    (folder / "AT_SUBMIT.txt").write_text("Created by `v4launch submit` (not by a dry run):\n\n"
                                          + "".join(f"* {line}\n" for line in dry.at_submit))
    return dry


_OURS = ("recipe.yaml", "chain.json", "AT_SUBMIT.txt")


def _check_folder(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--dry-run-dir {folder}: a file, not a folder", hint="name a folder (it is created)")
    if folder.is_dir():
        others = [p.name for p in folder.iterdir() if p.name not in _OURS and not p.name.endswith(".sbatch")]
        if others:
            raise UsageError(f"--dry-run-dir {folder} holds other files ({', '.join(sorted(others)[:5])}); nothing "
                             "was written", hint="name an empty or new folder, or one an earlier dry run wrote")
