"""The training job each rank runs: ``train(run_dir)``.

Reads only the run directory (recipe.yaml, resume.json, checkpoints/), so the same
call serves the local launcher, torchrun and Slurm (v4launch.slurm calls it on
every rank). See docs/training.md for what one step does and how resume decides.
"""

from __future__ import annotations

import threading
from pathlib import Path

from .result import TrainResult, TrainStatus

__all__ = ["train", "TrainResult", "TrainStatus"]


def train(run_dir: Path, *, stop_after_stage: bool = False, max_steps: int | None = None,
          stop_event: threading.Event | None = None, progress: bool = True) -> TrainResult:
    """Run (or continue) the curriculum of the run in ``run_dir`` on this rank.

    Args:
        run_dir: a directory made by ``v4launch.rundir.create_run_dir``.
        stop_after_stage: return ``"stage_completed"`` after the current stage's end checkpoint.
        max_steps: global optimizer-step cap: stop (checkpoint, ``"max_steps"``) once the run's
            step count reaches it; None = no cap.
        stop_event: when set, the job finishes the current step, saves and returns ``"stopped"``
            (SIGTERM / SIGINT set an internal event the same way when running in the main thread).
        progress: rich progress display on a TTY (plain log lines otherwise / when False).

    Returns:
        TrainResult(status, stage_index, step, checkpoint).
    """
    raise NotImplementedError("the training loop is being written")
