"""What every launcher shares: the interface, what a launch and a status report hold, and the run
directory's launch.json and metrics read the same way for every launcher.

``launchers`` (the local launcher and ``launcher_for``) and ``slurm.launcher`` / ``slurm.job`` build on this
module; it imports neither, so the Slurm code never reaches back into the module that dispatches to it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from .errors import RefusedError
from .rundir import RunPaths, write_json_atomic
from .training.result import TrainResult


@dataclass(frozen=True)
class LaunchInfo:
    """What ``launch`` did: the launcher name, a job id (Slurm) or pids (local), and the result when
    the launcher ran the job to its end in the foreground (local) — None when it was only submitted."""

    launcher: str
    run_dir: Path
    job_id: str | None = None
    result: TrainResult | None = None


@dataclass(frozen=True)
class RunStatus:
    """Where a run stands: state (running, completed, stopped, max_steps, stage_completed, failed,
    died, not launched), the last logged step, the latest checkpoint and launcher-specific details."""

    state: str
    launcher: str
    step: int | None = None
    stage: str | None = None
    checkpoint: Path | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Launcher(ABC):
    """Interface of every launcher. Implementations: ``launchers.LocalLauncher`` and ``slurm.launcher.SlurmLauncher``."""

    name: str = "abstract"

    @abstractmethod
    def launch(self, run_dir: Path, *, max_steps: int | None = None, progress: bool = True) -> LaunchInfo:
        """Start (or continue) the run in ``run_dir``; the job resumes from its latest checkpoint."""

    @abstractmethod
    def ensure_idle(self, run_dir: Path) -> None:
        """Refuse (RefusedError) while a launch of this run is still live; called before anything is written."""

    @abstractmethod
    def status(self, run_dir: Path) -> RunStatus:
        """Current state of the run (never raises for a run that simply has not started)."""

    @abstractmethod
    def cancel(self, run_dir: Path) -> None:
        """Ask the run to stop: it finishes the current step, saves a checkpoint and exits."""

    @abstractmethod
    def logs(self, run_dir: Path, follow: bool = False, rank: int | None = None,
             tail: int | None = None) -> Iterator[str]:
        """Lines of the run's log (rank 0 first, or only ``rank``'s); ``tail``: only the last ``tail`` lines of each
        log before following; with ``follow`` keep yielding until the run ends.

        Raises:
            UsageError: ``rank`` is not a rank of the run (0 .. world size - 1)."""


def read_launch(run_dir: Path) -> dict[str, Any]:
    """launch.json of a run ({} when the run was never launched)."""
    try:
        return json.loads(RunPaths(Path(run_dir)).launch.read_text())
    except (OSError, ValueError):
        return {}


def record_launch(run_dir: Path, **values: Any) -> dict[str, Any]:
    """Merge ``values`` into launch.json (atomically) and return the new content."""
    state = read_launch(run_dir)
    state.update(values, updated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    write_json_atomic(RunPaths(Path(run_dir)).launch, state)
    return state


def last_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The last training record of metrics.jsonl (None when nothing was logged yet)."""
    path = RunPaths(Path(run_dir)).metrics
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind", "train") == "train":
            return rec
    return None


def latest_checkpoint_path(run_dir: Path) -> Path | None:
    """Latest complete checkpoint of the run (None if none or the checkpoints package is missing)."""
    try:
        from .checkpoints import latest_checkpoint
    except ImportError:
        return None
    return latest_checkpoint(RunPaths(Path(run_dir)).checkpoints)


def nothing_to_cancel(run_dir: Path, what: str, state: str) -> RefusedError:
    """The refusal of ``cancel`` for a run with nothing live (``what``: e.g. "is not running (state: …)"):
    a run that finished its curriculum is pointed at ``status``, any other at ``resume``."""
    hint = (f"it finished its curriculum; `v4launch status {run_dir}` shows it" if state == "completed" else
            f"see `v4launch status {run_dir}`; continue it with `v4launch resume {run_dir}`")
    return RefusedError(f"run {Path(run_dir).name} {what}: nothing to cancel", hint=hint)


def files_status(run_dir: Path, launcher: str, state: str, detail: dict[str, Any]) -> RunStatus:
    """A RunStatus filled from the run directory's files (metrics and checkpoints).

    ``step`` is the furthest step the run is known to have reached: the last logged step, or the
    latest checkpoint's when that is later (``logging.interval_steps`` > 1 leaves steps unlogged), so
    the step and checkpoint columns of ``status`` agree.
    """
    from .checkpoints.listing import checkpoint_step

    rec = last_metrics(run_dir) or {}
    ckpt = latest_checkpoint_path(run_dir)
    step = rec.get("step")
    if ckpt is not None and (step is None or (checkpoint_step(ckpt) or 0) > step):
        step = checkpoint_step(ckpt)
    return RunStatus(state=state, launcher=launcher, step=step, stage=rec.get("stage"), checkpoint=ckpt, detail=detail)
