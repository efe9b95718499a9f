"""Submitting a run to Slurm: freeze the code revision, create the run directory, submit a job.

``prepare_run`` (called by ``v4launch submit``) refuses a dirty source tree unless allowed, then
creates the run directory with the git revision in run.json and, for a dirty tree, the diff
in ``code.diff``. ``submit_run`` (defined in ``job.py`` beside the job that chains the next
stage with it, so the two modules do not import each other) submits one job of a run and
records it in the ledger.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import RefusedError
from ..rundir import CODE_DIFF, CodeRevision, code_revision, record_code, update_run_extra  # noqa: F401 - re-exported
from .job import submit_run  # noqa: F401 - re-exported: the one way a run's job is submitted
from .render import render_sbatch


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
    """Where ``create_run_dir`` would put this run now (the dry run renders its scripts for it: ``dry_run.py``)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return workspace.runs_root(recipe.run.output_root) / f"{recipe.name}-{stamp}"


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
