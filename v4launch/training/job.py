"""The training job each rank runs: ``train(run_dir)``.

Reads only the run directory (recipe.yaml, run.json, resume.json, checkpoints/), so the same
call serves the local launcher, torchrun and Slurm (v4launch.slurm calls it on every rank).
docs/training.md describes what one step does, the loss composition and how resume decides.

Flow: join the process group → load the frozen recipe → plan the curriculum → build the model
(in the phase of the checkpoint being resumed, or of stage 0) and its optimizers → load the
checkpoint → for each remaining stage: change phase if needed (dense → warmup builds the
indexers and adds their parameters to the optimizers), train its steps, evaluate, checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

import torch

from ..rundir import consume_resume_request, load_run, read_resume_request
from .data_io import prepare_for_run
from .dist import init_distributed, teardown
from .metrics import MetricsLogger
from .result import TrainResult, TrainStatus
from .trackers import open_trackers
from .runner import Runner, refuse_missing_gpus

__all__ = ["train", "TrainResult", "TrainStatus"]


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event):
    """SIGTERM / SIGINT set ``stop`` (graceful: finish the step, save, return); a second SIGINT interrupts."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    entered = [False]  # a plain flag: no lock, so a signal arriving inside the handler cannot deadlock on it

    def handler(signum, frame):  # noqa: ARG001
        if signum == signal.SIGINT and stop.is_set():
            raise KeyboardInterrupt
        if entered[0]:  # a second signal during the first one's stop.set(): that call sets it
            return
        entered[0] = True
        # Event.set takes the event's (non-reentrant) lock; a SIGTERM burst (PR_SET_PDEATHSIG is sent again each
        # time the dead launcher's orphans pass to another of its threads) re-entered here inside it and hung
        # the worker for good
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def train(run_dir: Path, *, stop_after_stage: bool = False, max_steps: int | None = None,
          stop_event: threading.Event | None = None, progress: bool = True) -> TrainResult:
    """Run (or continue) the curriculum of the run in ``run_dir`` on this rank.

    Initialises torch.distributed from the environment when WORLD_SIZE > 1 (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT; gloo on CPU, nccl on CUDA) and tears it down at the end.
    Resumes from the latest complete checkpoint of the run, or from the one a pending
    ``resume.json`` (written by ``v4launch resume``) names, at the stage it names.

    Args:
        run_dir: a directory made by ``v4launch.rundir.create_run_dir``.
        stop_after_stage: return ``"stage_completed"`` after the current stage's end checkpoint.
        max_steps: global optimizer-step cap: once the run has done this many steps the job saves
            and returns ``"max_steps"``; None = no cap.
        stop_event: when set, the job finishes the current step, saves and returns ``"stopped"``
            (SIGTERM / SIGINT set an internal event the same way when running in the main thread).
        progress: rich progress display on a TTY (plain log lines otherwise / when False).

    Returns:
        TrainResult(status, stage_index, step, checkpoint).

    Raises:
        V4LaunchError: a user mistake the job cannot run with (a CP > 1 stage, a batch that does not
            divide, an unreadable run directory or checkpoint, data that cannot be prepared).
    """
    run_dir = Path(run_dir).resolve()
    run = load_run(run_dir)
    # before the process group binds this rank to its GPU (a missing one would fail there, inside CUDA)
    refuse_missing_gpus(run.recipe.cluster.gpu, int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
    info = init_distributed()
    stop = stop_event or threading.Event()
    try:
        with _stop_on_signals(stop):
            return _train(run, info, stop, stop_after_stage, max_steps, progress)
    finally:
        teardown(info)


def _train(run, info, stop, stop_after_stage, max_steps, progress) -> TrainResult:
    dataset = prepare_for_run(run.recipe, run.meta, run.paths.root, info)
    request = read_resume_request(run.paths.root)
    runner = Runner(run, info, dataset, request)
    if request is not None:
        if info.active:
            import torch.distributed as dist

            dist.barrier()
        if info.is_main:
            consume_resume_request(run.paths.root)
    # the step count and eta the log shows: where the job will stop (--max-steps), not the curriculum's end
    last_step = min(runner.total_steps, max_steps) if max_steps is not None else runner.total_steps
    trackers = open_trackers(run.recipe.logging, run.paths.root, run.recipe.model_dump(mode="json")) \
        if info.is_main else []  # logging.wandb: rank 0 only
    metrics = MetricsLogger(run.paths.root, rank=info.rank, total_steps=last_step,
                            tensorboard=run.recipe.logging.tensorboard, progress=progress,
                            start_step=runner.first_step, trackers=trackers)
    runner.metrics = metrics
    try:
        with runner.gc.during_training():  # run.gc_interval_steps: collections between timed steps only
            return _loop(runner, stop, stop_after_stage, max_steps)
    except BaseException:
        if not runner.info.active:  # the last queued step's record, if the device still answers (with ranks, its
            with contextlib.suppress(Exception):  # means are collectives the other ranks may never join)
                runner.flush_stats()
        raise
    finally:
        runner.close_profiler()  # after an error too: an open torch.profiler crashes the process at exit
        metrics.close()


def _loop(runner: Runner, stop: threading.Event, stop_after_stage: bool, max_steps: int | None) -> TrainResult:
    """Stages in order from where the run is; returns at the first reason to stop."""
    p = runner.progress
    runner.announce_start()
    while p.stage_index < len(runner.plans):
        plan = runner.plans[p.stage_index]
        if p.step_in_stage >= plan.steps:  # resumed at a stage-end checkpoint
            if p.stage_index + 1 == len(runner.plans):
                break
            p.stage_index, p.step_in_stage = p.stage_index + 1, 0
            continue
        runner.enter_stage(plan)
        halted = runner.run_stage(plan, stop, max_steps)
        if halted is not None:
            return runner.halt(halted, plan)
        runner.finish_stage(plan)
        if runner.stop_requested(stop):
            return runner.halt("stopped", plan)
        if max_steps is not None and p.step >= max_steps and p.stage_index + 1 < len(runner.plans):
            return runner.halt("max_steps", plan)
        if stop_after_stage and p.stage_index + 1 < len(runner.plans):
            return runner.halt("stage_completed", plan)
    return runner.halt("completed", runner.plans[min(p.stage_index, len(runner.plans) - 1)])
