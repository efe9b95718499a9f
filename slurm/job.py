"""What runs on every rank of a Slurm job: ``SlurmTrainJob(run_dir)()``.

A submitit ``Checkpointable`` that knows only the run directory. ``train()`` finds the latest
complete checkpoint by itself, so a requeued job can never resume from a stale path baked
into the pickle (fairchem #1055). The protocol on every rank (not only rank 0: submitit #9):

1. set the rendezvous environment (first node = MASTER_ADDR) and install handlers for the
   checkpoint signal (USR2, sent ``slurm.signal_delay_s`` before the time limit or as a
   preemption notice) and SIGTERM (preemption / requeue / cancel on clusters without it);
2. a handler only sets the job's ``stop_event``: ``train`` finishes the step, saves a
   checkpoint and returns ``"stopped"``;
3. once ``train`` returned, USR2 and SIGTERM are ignored until the process exits (a notice that
   lands after the stage finished is moot; submitit's own handler would requeue a finished job);
4. rank 0 then decides (``states.after_stop``, with the time the signal was caught and Slurm's
   EndTime / PreemptTime): requeue (``scontrol requeue``; the same pickle runs again), leave it
   to Slurm (already requeueing), or stop the run (cancel, the stage's slurm.max_segments used up);
   a requeue after a caught signal is a planned segment; slurm.max_restarts counts the others (failures);
   ``"stage_completed"`` submits the next stage as a new job.

Everything rank 0 sees is appended to ``<run_dir>/ledger.jsonl``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import submitit
from submitit.core.utils import DelayedSubmission

from . import ledger, query
from .render import make_executor, submit_with_retry
from .rendezvous import rendezvous_env
from .states import after_stop, on_start, requeue_outcome

DEFAULT_ENTRY = "v4launch.training.job:train"
"""The training function a job calls: ``module:function`` or ``/path/file.py:function``."""


class RestartBudgetExhausted(RuntimeError):
    """The run used up slurm.max_restarts failures or a stage's slurm.max_segments: the job stops instead of
    training again."""


def resolve_entry(entry: str) -> Callable[..., Any]:
    """Import ``module:function`` or ``/path/to/file.py:function``."""
    target, _, name = entry.rpartition(":")
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_v4launch_entry_{abs(hash(target))}", target)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        module = importlib.import_module(target)
    return getattr(module, name)


class SlurmTrainJob(submitit.helpers.Checkpointable):
    """The callable submitit pickles for each job of a run.

    Args:
        run_dir: the run directory (created by ``create_run_dir(..., launcher="slurm")``).
        max_steps: global optimizer-step cap passed to ``train`` (None = the whole curriculum).
        entry: the training function (tests use a stand-in).
    """

    def __init__(self, run_dir: str | Path, max_steps: int | None = None, entry: str = DEFAULT_ENTRY) -> None:
        self.run_dir = str(Path(run_dir).absolute())
        self.max_steps = max_steps
        self.entry = entry

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """The resubmission submitit requeues: a fresh job that knows only the run directory."""
        return DelayedSubmission(type(self)(self.run_dir, self.max_steps, self.entry))

    def __call__(self) -> dict[str, Any]:
        """Train this rank until the stage ends, the run ends, or a signal stops it."""
        env = submitit.JobEnvironment()
        job_id, rank = str(env.job_id), env.global_rank
        run_dir = Path(self.run_dir)
        recipe = _frozen_recipe(run_dir)
        os.environ.update(rendezvous_env(os.environ, recipe.slurm.master_port))
        if not self._record_start(run_dir, job_id, recipe, rank):
            return {"status": "not run", "detail": "this job had already ended"}
        stop, caught = threading.Event(), []
        _install_handlers(stop, caught)  # a signal only sets stop while training
        try:
            try:
                result = resolve_entry(self.entry)(run_dir, stop_after_stage=True, max_steps=self.max_steps,
                                                   stop_event=stop, progress=False)
            except Exception as exc:
                if rank == 0:
                    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                    ledger.append(run_dir, job_id, "failed", detail=last[:2000])
                raise
            if rank == 0:
                self._after_train(run_dir, job_id, recipe, result, caught[0] if caught else ("SIGTERM", time.time()))
        finally:
            # Training is over and its outcome recorded: a stop notice that lands now (a time limit just
            # after the stage ended) is moot. Never hand it back to submitit, whose handler would
            # requeue and kill a finished job: ignore it until the process exits, on every rank.
            _ignore_stop_signals()
        if result.status == "stopped":
            sys.exit(-1)  # like submitit after a requeue: no result pickle for an interrupted attempt
        return result.to_json()

    # ------------------------------------------------------------------ rank 0
    def _record_start(self, run_dir: Path, job_id: str, recipe: Any, rank: int) -> bool:
        """Ledger the (re)start (rank 0); False when this job must not train (it had already ended)."""
        events = ledger.read(run_dir)
        for event, detail in on_start(query.restart_count(), events, job_id, recipe.slurm.max_restarts):
            if rank == 0:
                ledger.append(run_dir, job_id, event, detail=detail or f"host {os.uname().nodename}")
            if event == "budget_exhausted":
                raise RestartBudgetExhausted(detail)
            if event == "exit":
                return False
        return True

    def _after_train(self, run_dir: Path, job_id: str, recipe: Any, result: Any, caught: tuple[str, float]) -> None:
        # Training is over: a late notice is moot, and Slurm signals every process of the step, so the
        # sbatch / scontrol children started below must not die of it (ignored dispositions are inherited).
        _ignore_stop_signals()
        where = {"stage": result.stage_index, "step": result.step}
        ckpt = f"checkpoint {Path(result.checkpoint).name}" if result.checkpoint else "no checkpoint"
        if result.status == "completed":
            ledger.append(run_dir, job_id, "completed", detail=ckpt, **where)
        elif result.status == "max_steps":
            ledger.append(run_dir, job_id, "exit", detail=f"max_steps={self.max_steps} reached; {ckpt}", **where)
        elif result.status == "stage_completed":
            ledger.append(run_dir, job_id, "stage_completed", detail=ckpt, **where)
            if ledger.cancel_requested(ledger.read(run_dir), job_id):
                ledger.append(run_dir, job_id, "exit", detail="cancelled: next stage not submitted", **where)
            else:
                self._submit_next_stage(run_dir, job_id, recipe, result.stage_index + 1)
        elif result.status == "stopped":
            self._after_stop(run_dir, job_id, recipe, caught, where, ckpt)

    def _after_stop(self, run_dir: Path, job_id: str, recipe: Any, caught: tuple[str, float], where: dict,
                    ckpt: str) -> None:
        signal_name, caught_at = caught
        events = ledger.read(run_dir)
        ledger.append(run_dir, job_id, "signal", detail=f"{signal_name}: stopped after the step; {ckpt}", **where)
        state = query.stop_state(job_id, query.restart_count())
        end, preempted = query.end_and_preemption(job_id)
        segments = ledger.segments_used(events, where["stage"])  # time limits are planned, not failures
        decision = after_stop(signal_name, state, segments, recipe.slurm.max_segments,
                              cancel=ledger.cancel_requested(events, job_id),
                              time_left_s=None if end is None else end - caught_at,
                              signal_delay_s=recipe.slurm.signal_delay_s, preempted=preempted)
        if decision.action == "requeue":
            decision = requeue_outcome(decision, query.requeue(job_id))
        ledger.append(run_dir, job_id, decision.event, detail=f"{decision.detail} [Slurm state {state}]", **where)
        if decision.event == "budget_exhausted":
            raise RestartBudgetExhausted(decision.detail)

    def _submit_next_stage(self, run_dir: Path, job_id: str, recipe: Any, stage_index: int) -> None:
        try:
            submit_run(run_dir, max_steps=self.max_steps, entry=self.entry, env=query.clean_submit_env(dict(os.environ)),
                       stage=stage_index, detail=f"stage {stage_index} chained from job {job_id}")
        except Exception as exc:  # the run must say why the curriculum stopped here
            ledger.append(run_dir, job_id, "failed", stage=stage_index,
                          detail=f"could not submit stage {stage_index}: {exc}")
            raise


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
    from ..launcher_base import record_launch
    from ..rundir import load_run

    run_dir = Path(run_dir).absolute()
    recipe = load_run(run_dir).recipe
    executor = make_executor(recipe, run_dir, job_name=run_dir.name)
    job_id = submit_with_retry(executor, SlurmTrainJob(run_dir, max_steps=max_steps, entry=entry), env=env)
    ledger.append(run_dir, job_id, "submit", stage=stage, detail=detail or "submitted")
    jobs = ledger.job_ids(ledger.read(run_dir))
    record_launch(run_dir, launcher="slurm", state="submitted", job_id=job_id, job_ids=jobs)
    return job_id


def _frozen_recipe(run_dir: Path) -> Any:
    from ..rundir import load_run

    return load_run(run_dir).recipe


def _install_handlers(stop: threading.Event, caught: list[tuple[str, float]]) -> dict[int, Any]:
    """USR2 and SIGTERM set ``stop`` (every rank) and record (signal name, time caught); returns the
    previous handlers."""
    usr = submitit.JobEnvironment._usr_sig()

    def handler(signum: int, frame: Any) -> None:
        caught.append(("USR2" if signum == usr else signal.Signals(signum).name, time.time()))
        stop.set()

    previous = {}
    for sig in (signal.SIGTERM, usr):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _ignore_stop_signals() -> None:
    """USR2 and SIGTERM ignored from here on (a finished job's late notices; inherited by children)."""
    for sig in (signal.SIGTERM, submitit.JobEnvironment._usr_sig()):
        signal.signal(sig, signal.SIG_IGN)
