"""``SlurmLauncher``: the launcher interface (launch, status, cancel, logs) for Slurm runs.

A Slurm run is a chain of jobs (one per curriculum stage, each possibly requeued); this class
joins the ledger, squeue/sacct, metrics.jsonl and the checkpoints into one view of the run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import RefusedError
from ..launcher_base import LaunchInfo, Launcher, RunStatus, last_metrics, latest_checkpoint_path, nothing_to_cancel
from ..run_logs import follow_files
from . import ledger, query
from .render import SUBMITIT_DIR
from .states import job_state, run_state

LIVE_VIEW = ("pending", "running", "requeued")


@dataclass(frozen=True)
class JobRow:
    """One Slurm job of a run, as ``v4launch status`` shows it."""

    job_id: str
    state: str
    slurm_state: str
    stage: str | None
    phase: str | None
    step: int | None
    loss: float | None
    checkpoint: str | None
    restarts: int
    detail: str


def job_log_paths(run_dir: Path, job_id: str, task: int = 0) -> tuple[Path, Path]:
    """(stdout, stderr) log files of one task of a job (submitit's ``%j_%t_log.out/.err``)."""
    folder = Path(run_dir) / SUBMITIT_DIR
    return folder / f"{job_id}_{task}_log.out", folder / f"{job_id}_{task}_log.err"


def log_tail(run_dir: Path, job_id: str, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of rank 0's log (a separate stderr file first, for runs of older versions)."""
    for path in reversed(job_log_paths(run_dir, job_id)):
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        if text:
            return text[-lines:]
    return []


def _stage_info(recipe: Any, stage: Any) -> tuple[str | None, str | None]:
    stages = recipe.curriculum.stages
    if isinstance(stage, int) and 0 <= stage < len(stages):
        return stages[stage].name, stages[stage].phase
    for s in stages:
        if s.name == stage:
            return s.name, s.phase
    return (None if stage is None else str(stage)), None


def job_rows(run_dir: Path, recipe: Any) -> list[JobRow]:
    """One row per Slurm job of the run, oldest first."""
    events = ledger.read(run_dir)
    ids = ledger.job_ids(events)
    states = query.current_states(ids)
    waiting = query.pending_reasons(j for j, s in states.items() if (s or "").upper().startswith("PENDING"))
    metrics = last_metrics(run_dir) or {}
    ckpt = latest_checkpoint_path(run_dir)
    failed = [j for j, s in states.items() if query_state_word(s) == "FAILED"]
    exits = {j: rec.get("ExitCode") for j, rec in query.accounting(failed).items()}  # how a FAILED job ended
    rows = []
    for n, job_id in enumerate(ids):
        mine = ledger.for_job(events, job_id)
        view = job_state(states.get(job_id), mine, exits.get(job_id))
        newest = n == len(ids) - 1
        staged = [e.stage for e in mine if e.stage is not None]
        stage_key = staged[-1] if staged else (metrics.get("stage") if newest else None)
        stepped = [e.step for e in mine if e.step is not None]
        step = metrics.get("step") if newest and (view in LIVE_VIEW or not stepped) else (stepped[-1] if stepped else None)
        name, phase = _stage_info(recipe, stage_key)
        last = next((e for e in reversed(mine) if e.event not in ("submit", "start")), mine[-1] if mine else None)
        requeued = next((e for e in reversed(mine) if e.event == "requeue"), None) if view == "requeued" else None
        rows.append(JobRow(job_id=job_id, state=view, slurm_state=query_state_word(states.get(job_id)), stage=name,
                           phase=phase, step=step, loss=metrics.get("lm_loss", metrics.get("loss")) if newest else None,
                           checkpoint=ckpt.name if (newest and ckpt) else None,
                           restarts=sum(1 for e in mine if e.event == "requeue"),
                           detail=_unrecorded_end(view, mine, exits.get(job_id), run_dir)
                           or _detail(requeued, last, waiting.get(job_id))))
    return rows


def _unrecorded_end(view: str, mine: list[Any], exit_code: str | None, run_dir: Path) -> str | None:
    """The status line of a job Slurm ended FAILED without the job recording why (no ``failed`` event in
    the ledger: it never got to write one): killed by SIGKILL (``stopped``, docs/slurm.md), or another
    signal or exit code; None for any other job."""
    from .states import TERMINAL_EVENTS, exit_signal

    if view not in ("stopped", "failed") or any(e.event in TERMINAL_EVENTS for e in mine):
        return None
    sig = exit_signal(exit_code)
    if view == "stopped":
        return (f"killed by SIGKILL (ExitCode {exit_code}) for a reason Slurm does not tell; not requeued: "
                f"`v4launch resume {run_dir}` continues from the latest checkpoint")
    how = f"killed by signal {sig}" if sig else f"ExitCode {exit_code or 'unknown'}"
    return f"Slurm says FAILED ({how}) and the job recorded no error: its log's last lines say how far it got"


def _detail(requeued: Any, last: Any, waiting: str | None) -> str:
    """A job's status line: why it was requeued (the ledger's reason, not the "BeginTime" Slurm gives
    every requeued job while it waits), else why it is pending, else its last event."""
    if requeued is not None:
        return f"requeue: {requeued.detail}" + (f" (waiting to restart: {waiting})" if waiting else "")
    if waiting:
        return f"pending: {waiting}"
    return f"{last.event}: {last.detail}" if last else ""


def query_state_word(state: str | None) -> str:
    """Slurm's state word as shown in the table (``CANCELLED by 0`` → ``CANCELLED``)."""
    from .states import normalise

    return normalise(state)


class SlurmLauncher(Launcher):
    """Launcher for runs whose run.json says ``"launcher": "slurm"``."""

    name = "slurm"

    def launch(self, run_dir: Path, *, max_steps: int | None = None, progress: bool = True) -> LaunchInfo:
        """Submit a job that continues the run from its latest checkpoint (``v4launch resume``).

        Raises:
            RefusedError: a job of this run is still queued or running.
            V4LaunchError: Slurm is missing or refused the job.
        """
        from .submit import submit_run

        self.ensure_idle(run_dir)
        job_id = submit_run(run_dir, max_steps=max_steps, detail="relaunched")
        return LaunchInfo(launcher=self.name, run_dir=Path(run_dir), job_id=job_id)

    def ensure_idle(self, run_dir: Path) -> None:
        """Refuse while a Slurm job of this run is still queued or running."""
        live = self.live_jobs(run_dir)
        if live:
            raise RefusedError(f"run {Path(run_dir).name} still has live Slurm job(s) {', '.join(live)}",
                               hint=f"wait for them, or stop them with `v4launch cancel '{run_dir}'`")

    def live_jobs(self, run_dir: Path) -> list[str]:
        """Job ids of the run that are still queued or running."""
        ids = ledger.job_ids(ledger.read(run_dir))
        return [j for j, s in query.queue_states(ids).items() if s.upper() not in ("COMPLETED", "CANCELLED", "FAILED")]

    def status(self, run_dir: Path) -> RunStatus:
        """The run's state and one row per job in ``detail["jobs"]`` (plus the log tail of a failed job)."""
        from ..rundir import load_run

        run_dir = Path(run_dir)
        recipe = load_run(run_dir).recipe
        rows = job_rows(run_dir, recipe)
        state = run_state([r.state for r in rows])
        metrics = last_metrics(run_dir) or {}
        events = ledger.read(run_dir)
        detail: dict[str, Any] = {"jobs": [asdict(r) for r in rows],
                                  "restarts": sum(r.restarts for r in rows),
                                  "segments": ledger.segments_used(events),  # planned: time limits, preemptions
                                  "failures": ledger.restarts_used(events),  # counted against max_restarts
                                  "max_restarts": recipe.slurm.max_restarts,
                                  "max_segments": recipe.slurm.max_segments}
        if rows and state in ("failed", "node failure", "timeout", "unknown"):
            detail["log_tail"] = log_tail(run_dir, rows[-1].job_id)
            out, err = job_log_paths(run_dir, rows[-1].job_id)
            detail["log"] = str(err if err.exists() else out)
            ended = [e for e in ledger.read(run_dir) if e.event in ("failed", "budget_exhausted")]
            if ended:
                detail["failure"] = f"job {ended[-1].job_id} {ended[-1].event}: {ended[-1].detail}"
            elif rows[-1].detail:  # ended by Slurm before the job could record why
                detail["failure"] = f"job {rows[-1].job_id}: {rows[-1].detail}"
        stage = rows[-1].stage if rows else metrics.get("stage")
        return RunStatus(state=state, launcher=self.name, step=rows[-1].step if rows else metrics.get("step"),
                         stage=stage, checkpoint=latest_checkpoint_path(run_dir), detail=detail)

    def cancel(self, run_dir: Path) -> None:
        """Cancel every live job of the run: the running one checkpoints and stops (SIGTERM), queued ones go.

        Raises:
            RefusedError: no job of the run is live, or scancel failed.
        """
        live = self.live_jobs(run_dir)
        if not live:
            raise nothing_to_cancel(run_dir, "has no queued or running Slurm job", self.status(run_dir).state)
        for job_id in live:  # recorded first: the job reads it when its SIGTERM arrives
            ledger.append(run_dir, job_id, "cancel", detail="v4launch cancel")
        error = query.cancel(live)
        if error:
            raise RefusedError(f"scancel {' '.join(live)} failed: {error}", hint="check `squeue` and retry")

    def logs(self, run_dir: Path, follow: bool = False, rank: int | None = None,
             tail: int | None = None) -> Iterator[str]:
        """Rank 0's job log (or task ``rank``'s) of every job of the run in order; ``tail``: the last lines of each
        job's log; with ``follow``, keep yielding from the live job, and from the jobs it chains, until none is
        live. A job's stdout and stderr are one stream (``stderr_to_stdout``), so its lines come in the order they
        were written; a separate stderr file (runs submitted by older versions) follows its stdout.

        Raises:
            UsageError: ``rank`` is not a rank of the run (0 .. cluster.nodes · gpus_per_node - 1)."""
        from ..run_logs import check_rank
        from ..rundir import load_run

        if rank is not None:
            check_rank(run_dir, rank, load_run(run_dir).recipe.cluster.world_size)
        shown: set[str] = set()
        while True:
            new = [j for j in ledger.job_ids(ledger.read(run_dir)) if j not in shown]
            for job_id in new:
                shown.add(job_id)
                yield f"==> job {job_id} <=="
                out, err = job_log_paths(run_dir, job_id, task=rank or 0)
                paths = [out, err] if err.exists() else [out]
                alive = (lambda j=job_id: bool(query.queue_states([j]))) if follow else (lambda: False)
                yield from follow_files(paths, alive, tail=tail)
            if not follow or (not new and not self.live_jobs(run_dir)):
                return
            if not new:
                time.sleep(1.0)
