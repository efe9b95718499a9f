"""The submitit ``SlurmExecutor`` of a run: exact sbatch rendering (dry run) and submission.

The dry run and the real submission render through the same submitit code path
(``SlurmExecutor._make_submission_file_text``), so ``submit --dry-run`` prints byte for byte
the script that sbatch receives. Always ``submitit.SlurmExecutor``, never ``AutoExecutor``:
a test or a laptop must never fall back to submitit's local executor by accident.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from ..errors import RecipeError, V4LaunchError
from .params import check_path, executor_parameters

SUBMITIT_DIR = "slurm"
"""Sub-folder of the run directory holding submitit's pickles, sbatch scripts and job logs."""

# Transient sbatch failures worth retrying (controller busy, RPC timeouts: submitit #1659).
_TRANSIENT = ("Socket timed out", "temporarily unable", "Unable to contact slurm controller",
              "Resource temporarily unavailable", "Zero Bytes were transmitted")


# Slurm may deliver --signal up to 60 s early, i.e. while Python is still starting and has no
# handler yet: USR2's default action would kill the task. The task therefore starts with USR2
# ignored (inherited through exec) until submitit and the job install their handlers; a notice
# lost in that window is covered by SIGTERM at the limit, which the job handles the same way.
_SH_WRAPPER = 'trap "" USR2; exec "$0" "$@"'


def python_command() -> str:
    """The interpreter command each task runs (this Python, behind the USR2-ignoring exec)."""
    return f"/bin/sh -c {shlex.quote(_SH_WRAPPER)} {shlex.quote(sys.executable)}"


class _RenderOnlyExecutor(submitit.SlurmExecutor):
    """A SlurmExecutor that can be built without Slurm installed, used only to render text."""

    @classmethod
    def affinity(cls) -> int:  # submitit refuses to build a SlurmExecutor without srun on PATH
        return 1


def submitit_folder(run_dir: Path) -> Path:
    """Where submitit keeps the run's job files: ``<run_dir>/slurm``.

    Raises:
        RecipeError: the path cannot be used in an sbatch script (control characters, '%').
    """
    folder = Path(run_dir).absolute() / SUBMITIT_DIR
    check_path("run directory", folder)
    return folder


def _configure(executor: submitit.SlurmExecutor, params: dict[str, Any]) -> submitit.SlurmExecutor:
    try:
        executor.update_parameters(**params)
    except ValueError as exc:  # submitit lists every valid parameter in its message
        raise RecipeError(f"invalid Slurm parameters: {exc}", hint="check the recipe's slurm: section") from None
    return executor


def render_sbatch(recipe: Any, run_dir: Path, job_name: str) -> str:
    """The exact sbatch script ``submit`` would hand to Slurm for ``recipe`` in ``run_dir``.

    Raises:
        RecipeError: a value that cannot be put into the script safely, or an invalid parameter.
    """
    folder = submitit_folder(run_dir)
    executor = _configure(_RenderOnlyExecutor(folder=folder, max_num_timeout=0, python=python_command()),
                          executor_parameters(recipe, job_name))
    return executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run")


def make_executor(recipe: Any, run_dir: Path, job_name: str) -> submitit.SlurmExecutor:
    """A real ``submitit.SlurmExecutor`` for ``recipe`` writing into ``<run_dir>/slurm``.

    Raises:
        V4LaunchError: Slurm's client tools are not on PATH.
        RecipeError: as :func:`render_sbatch`.
    """
    folder = submitit_folder(run_dir)
    params = executor_parameters(recipe, job_name)
    try:
        # Timeouts are requeued by v4launch itself (restart budget slurm.max_restarts).
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=recipe.slurm.max_restarts,
                                          python=python_command())
    except RuntimeError:
        raise V4LaunchError("Slurm is not available here: `srun` is not on PATH",
                            hint="submit from a Slurm login node, start the dev cluster with "
                                 "`scripts/dev-cluster up`, or run locally with `v4launch run`") from None
    return _configure(executor, params)


def _refusal_hint(sbatch_text: str) -> str:
    """What to check after sbatch refused a job: the controller when sbatch could not reach it (the recipe is not
    at fault then), else the recipe's partition / account / qos."""
    if "contact slurm controller" in sbatch_text.lower() or "connection refused" in sbatch_text.lower():
        return ("sbatch could not reach the Slurm controller: check it with `scontrol ping` (on this repository's "
                "one-node test cluster: `./scripts/dev-cluster up`), then submit again")
    return "check partition / account / qos in the recipe's slurm: section and `sinfo`"


def submit_with_retry(executor: submitit.SlurmExecutor, fn: Callable[[], Any], *, attempts: int = 4,
                      backoff_s: float = 2.0, env: dict[str, str] | None = None) -> str:
    """Submit ``fn`` and return the Slurm job id; retry transient sbatch failures with backoff.

    Args:
        env: when given, the environment sbatch runs with (the job inherits it); default: os.environ.

    Raises:
        V4LaunchError: sbatch refused the job (its message is included) or kept failing.
    """
    saved = dict(os.environ) if env is not None else None
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        for attempt in range(1, attempts + 1):
            try:
                return str(executor.submit(fn).job_id)
            except (FailedJobError, FailedSubmissionError, OSError) as exc:
                text = str(exc)
                if attempt == attempts or not any(t.lower() in text.lower() for t in _TRANSIENT):
                    raise V4LaunchError(f"sbatch refused the job: {text.strip()[-800:]}",
                                        hint=_refusal_hint(text)) from None
                time.sleep(backoff_s * attempt)
    finally:
        if saved is not None:
            os.environ.clear()
            os.environ.update(saved)
    raise AssertionError("unreachable")
