"""Experiment trackers beside TensorBoard: Weights & Biases (``logging.wandb``), on rank 0 only.

:class:`~.metrics.MetricsLogger` hands every tracker the scalars it writes to TensorBoard (same names,
same steps): ``tracker.log({name: value}, step)``, then ``tracker.close()`` at the job's end. wandb is an
optional extra (``pip install 'v4launch[wandb]'``), imported here only when a recipe enables it;
``v4launch validate`` checks it is installed (V4-WANDB-INSTALLED).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from ..errors import UsageError


def wandb_run_id(run_dir: Path) -> str:
    """A W&B run id that is the same for every job of one run directory (so a resumed run continues the same
    W&B run) and differs between directories: the directory's name (W&B's allowed characters, at most 40)
    and 8 hex digits of its absolute path's SHA-1."""
    run_dir = Path(run_dir).resolve()
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', run_dir.name)[:40]}-{digest}"


class WandbLogger:
    """One W&B run per run directory, resumed by every later job of that directory.

    Args:
        config: ``recipe.logging.wandb`` (project, name, mode).
        run_dir: the run directory; W&B's own files go under its ``wandb/`` folder (offline mode: only there).
        recipe: the recipe as a plain dict, stored as the W&B run's config.
    Raises:
        UsageError: wandb is not installed (with the install command), or ``wandb.init`` failed (e.g. online
            mode without a login), naming logging.wandb and the fix.
    """

    def __init__(self, config: Any, run_dir: Path, recipe: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise UsageError(f"logging.wandb.mode = {config.mode}: the wandb package is not installed where the "
                             "job runs", hint="fix: pip install 'v4launch[wandb]' (or pip install wandb) on the "
                             "nodes that run the job, or set logging.wandb.mode=disabled") from None
        run_dir = Path(run_dir)
        try:
            self._run = wandb.init(project=config.project, name=config.name or run_dir.name, mode=config.mode,
                                   dir=str(run_dir), id=wandb_run_id(run_dir), resume="allow", config=recipe)
        except Exception as exc:  # wandb raises its own types (no login, no network): all mean the same here
            raise UsageError(f"logging.wandb (project {config.project}, mode {config.mode}): wandb.init failed: "
                             f"{exc}", hint="fix: `wandb login` (or set WANDB_API_KEY) for mode online, or set "
                             "logging.wandb.mode=offline (sync later with `wandb sync`)") from None

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Log ``scalars`` (TensorBoard's tags as keys) at optimizer step ``step``."""
        self._run.log(scalars, step=step)

    def close(self) -> None:
        """Finish the W&B run (flushes; offline mode leaves it ready for ``wandb sync``)."""
        self._run.finish()


def open_trackers(logging: Any, run_dir: Path, recipe: dict[str, Any]) -> list[Any]:
    """The trackers ``logging`` (``recipe.logging``) enables, for rank 0: a :class:`WandbLogger` when
    ``logging.wandb`` is set and its mode is not ``disabled``; else none. Raises as :class:`WandbLogger`."""
    wandb = logging.wandb
    if wandb is None or wandb.mode == "disabled":
        return []
    return [WandbLogger(wandb, run_dir, recipe)]
