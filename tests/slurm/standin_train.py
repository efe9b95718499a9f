"""A fast stand-in for ``v4launch.training.job.train`` with the same contract.

Used by the Slurm protocol tests (time limit, restart budget, cancel) where the real model's
step time would only make the tests slower. It reads the frozen recipe, resumes from its own
latest checkpoint file, appends metrics.jsonl records shaped like the real ones, honours
``stop_event`` (finish the step, checkpoint, return "stopped") and ``stop_after_stage``.
A recipe with ``run.seed: 666`` raises at step 2 (the crash test). Each step prints a line to stdout
and one to stderr (the log-order test). With ``STANDIN_LATE_USR2=1`` in its environment, a job that
completed its stage keeps sending itself the checkpoint signal (USR2) every 2 ms until it exits: a
time-limit notice landing after the stage finished, while the process lingers 1.5 s at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from v4launch.training.result import TrainResult

STEP_S = float(os.environ.get("STANDIN_STEP_S", "0.5"))


def _latest(ckpt_dir: Path) -> dict:
    files = sorted(ckpt_dir.glob("standin_step_*.json"))
    return json.loads(files[-1].read_text()) if files else {"step": 0, "stage_index": 0, "step_in_stage": 0}


def _save(ckpt_dir: Path, state: dict) -> Path:
    path = ckpt_dir / f"standin_step_{state['step']:08d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return path


def train(run_dir, *, stop_after_stage=False, max_steps=None, stop_event=None, progress=True):
    """Count steps through the curriculum of ``run_dir`` (0.5 s per step)."""
    from v4launch.rundir import load_run

    run_dir = Path(run_dir)
    recipe = load_run(run_dir).recipe
    ckpt_dir = run_dir / "checkpoints"
    state = _latest(ckpt_dir)
    stages = recipe.curriculum.stages
    interval = recipe.checkpointing.interval_steps
    metrics = (run_dir / "metrics.jsonl").open("a", buffering=1) if os.environ.get("RANK", "0") == "0" \
        else open(os.devnull, "w")
    metrics.write(json.dumps({"kind": "event", "event": "start", "step": state["step"],
                              "resumed_from": state["step"], "job": os.environ.get("SLURM_JOB_ID")}) + "\n")
    last = None
    while state["stage_index"] < len(stages):
        stage = stages[state["stage_index"]]
        while state["step_in_stage"] < stage.steps:
            time.sleep(STEP_S)
            state["step"] += 1
            state["step_in_stage"] += 1
            if recipe.run.seed == 666 and state["step"] == 2:
                raise RuntimeError("stand-in crash at step 2 (run.seed=666)")
            print(f"standin step {state['step']} stdout", flush=True)
            print(f"standin step {state['step']} stderr", file=sys.stderr, flush=True)
            metrics.write(json.dumps({"kind": "train", "stage": stage.name, "stage_index": state["stage_index"],
                                      "phase": stage.phase, "step": state["step"], "lm_loss": 5.0 / state["step"],
                                      "job": os.environ.get("SLURM_JOB_ID"),
                                      "restart": os.environ.get("SLURM_RESTART_COUNT", "0")}) + "\n")
            if state["step"] % interval == 0:
                last = _save(ckpt_dir, state)
            if stop_event is not None and stop_event.is_set():
                last = _save(ckpt_dir, state)
                return TrainResult("stopped", state["stage_index"], state["step"], last)
            if max_steps is not None and state["step"] >= max_steps:
                last = _save(ckpt_dir, state)
                return TrainResult("max_steps", state["stage_index"], state["step"], last)
        done_index = state["stage_index"]
        state["stage_index"] += 1
        state["step_in_stage"] = 0
        last = _save(ckpt_dir, state)
        if state["stage_index"] < len(stages) and stop_after_stage:
            if os.environ.get("STANDIN_LATE_USR2") == "1":
                threading.Thread(target=_late_notices, daemon=True).start()
                atexit.register(time.sleep, 1.5)  # the process lingers after its result, as torch's teardown does
            return TrainResult("stage_completed", done_index, state["step"], last)
    return TrainResult("completed", len(stages) - 1, state["step"], last)


def _late_notices() -> None:
    """USR2 to this process every 2 ms (until it exits): Slurm's time-limit notice, after the stage ended."""
    while True:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.002)
