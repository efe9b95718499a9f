"""Submitting a run to Slurm: freeze the code revision, create the run directory, submit a job.

``prepare_run`` (called by ``v4launch submit``) refuses a dirty source tree unless allowed, then
creates the run directory with the git revision in run.json and, for a dirty tree, the diff
in ``code.diff``. ``submit_run`` submits one job of a run (the first stage, the next stage from
inside a job, or a relaunch by ``v4launch resume``) and records it in the ledger.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import RefusedError
from ..rundir import CODE_DIFF, CodeRevision, code_revision, record_code, update_run_extra  # noqa: F401 - re-exported
from . import ledger
from .job import DEFAULT_ENTRY, SlurmTrainJob
from .render import make_executor, render_sbatch, submit_with_retry


def check_clean(rev: CodeRevision, allow_dirty: bool) -> None:
    """Refuse a dirty tree unless ``allow_dirty`` (NeMo-Run #40: uncommitted edits silently lost).

    Raises:
        RefusedError: the tree has uncommitted changes or untracked files.
    """
    if rev.dirty and not allow_dirty:
        n = len([line for line in rev.diff.splitlines() if line.startswith("diff --git")])
        raise RefusedError(
            f"the source tree {rev.repo} has uncommitted changes ({n} changed file(s), "
            f"{len(rev.untracked)} untracked): the run could not be reproduced from commit {rev.sha}",
            hint="commit your changes, or pass --allow-dirty to submit anyway (the diff is saved in the run directory)")


def predicted_run_dir(recipe: Any, workspace: Any) -> Path:
    """Where ``create_run_dir`` would put this run now (used by the dry run's rendering)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return workspace.runs_root(recipe.run.output_root) / f"{recipe.name}-{stamp}"


def dry_run_script(loaded: Any, workspace: Any) -> str:
    """The exact sbatch script of the first job, rendered for the run directory that would be created.

    Raises:
        RecipeError: a value that cannot be put into an sbatch script safely.
    """
    run_dir = predicted_run_dir(loaded.recipe, workspace)
    return render_sbatch(loaded.recipe, run_dir, job_name=run_dir.name)


def prepare_run(loaded: Any, rev: CodeRevision, *, workspace: Any = None) -> Path:
    """Create the run directory of a Slurm run (frozen recipe, code revision, diff if dirty).

    Raises:
        RecipeError: the recipe's slurm: section cannot be rendered safely (checked before anything is created).
    """
    from ..rundir import create_run_dir

    # Render once against the predicted path so a bad value fails before the run directory exists.
    render_sbatch(loaded.recipe, predicted_run_dir(loaded.recipe, workspace or _workspace()), job_name="check")
    run_dir = create_run_dir(loaded, launcher="slurm", workspace=workspace,
                             extra={"slurm": {"nodes": loaded.recipe.cluster.nodes,
                                              "tasks_per_node": loaded.recipe.cluster.gpus_per_node}})
    update_run_extra(run_dir, record_code(run_dir, rev))
    return run_dir


def _workspace() -> Any:
    from ..workspace import Workspace

    return Workspace.current()


def submit_run(run_dir: Path, *, max_steps: int | None = None, entry: str = DEFAULT_ENTRY,
               env: dict[str, str] | None = None, stage: int | None = None, detail: str = "") -> str:
    """Submit one job of the run in ``run_dir``; returns its Slurm job id.

    The job resumes from the run's latest complete checkpoint (train() finds it), so the same
    call starts a run, continues it with the next stage, or relaunches it after a stop.

    Args:
        env: environment for sbatch (from inside a job: without the job's own SLURM_* variables).
        stage: curriculum stage index recorded in the ledger (informational).
        detail: ledger text, e.g. "stage 1 chained from job 12".

    Raises:
        V4LaunchError: Slurm is missing or refused the job.
    """
    from ..launchers import record_launch
    from ..rundir import load_run

    run_dir = Path(run_dir).absolute()
    recipe = load_run(run_dir).recipe
    executor = make_executor(recipe, run_dir, job_name=run_dir.name)
    job_id = submit_with_retry(executor, SlurmTrainJob(run_dir, max_steps=max_steps, entry=entry), env=env)
    ledger.append(run_dir, job_id, "submit", stage=stage, detail=detail or "submitted")
    jobs = ledger.job_ids(ledger.read(run_dir))
    record_launch(run_dir, launcher="slurm", state="submitted", job_id=job_id, job_ids=jobs)
    return job_id
