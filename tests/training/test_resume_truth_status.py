"""`status` tells the whole truth about a local run (issue 21): the rank that failed first with its
exit code or signal and its log tail, step and checkpoint columns that agree, and 'cancelled' for a
user cancel as on Slurm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from v4launch.checkpoints import latest_checkpoint

EXE = str(Path(sys.executable).with_name("v4launch"))
LONG = {"curriculum": {"stages": [{"name": "dense", "seq_len": 64, "phase": "dense", "steps": 5000}]}}


def v4launch(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1"))


def start_run(workspace: Path, recipe: Path) -> tuple[subprocess.Popen, Path]:
    """`v4launch run RECIPE --no-progress` in the background, once its first step is logged."""
    proc = subprocess.Popen([EXE, "run", str(recipe), "--no-progress"], cwd=workspace, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if " step 1/" in line or time.monotonic() > deadline:
            break
    (run,) = (workspace / "runs").iterdir()
    return proc, run


@pytest.mark.slow
def test_a_killed_rank_is_named_with_its_signal_and_log_tail(workspace, write_recipe):
    recipe = write_recipe(over={**LONG, "cluster": {"gpus_per_node": 2}, "logging": {"interval_steps": 1}})
    proc, run = start_run(workspace, recipe)
    time.sleep(2)
    pids = json.loads((run / "launch.json").read_text())["pids"]
    os.kill(pids[1], signal.SIGKILL)  # rank 1 dies; rank 0 then fails in its next collective
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (out[-2000:], err[-2000:])
    headline = " ".join(err.split())
    assert "failed: rank 1 killed by SIGKILL (signal 9) first" in headline, headline
    st = v4launch("status", run, "--json", cwd=workspace)
    assert st.returncode == 1
    detail = json.loads(st.stdout)
    assert detail["state"] == "failed" and detail["failed_rank"] == 1
    # a SIGKILLed rank writes no error: its own log says how far it got
    log = run / "logs" / ("worker1.out" if (run / "logs" / "worker1.out").read_text().strip() else "rank1.log")
    assert detail["log"] == str(log) and detail["log_tail"] == log.read_text().rstrip().splitlines()[-20:]
    assert detail["log_tail"]
    human = v4launch("status", run, cwd=workspace)
    text = " ".join(human.stdout.split())
    assert human.returncode == 1 and "why: rank 1 killed by SIGKILL" in text and "last lines of" in text


@pytest.mark.slow
def test_cancel_reads_cancelled_and_step_matches_the_checkpoint(workspace, write_recipe):
    # only the first step and stage ends are logged: the cancel lands on an unlogged step
    recipe = write_recipe(over={**LONG, "logging": {"interval_steps": 1000}})
    proc, run = start_run(workspace, recipe)
    time.sleep(3)
    cancel = v4launch("cancel", run, cwd=workspace)
    assert cancel.returncode == 0 and "cancelled run" in cancel.stdout, cancel.stderr
    proc.communicate(timeout=300)
    assert proc.returncode == 130
    ckpt = latest_checkpoint(run / "checkpoints")
    step = int(ckpt.name.split("_")[1])
    assert step > 1
    st = json.loads(v4launch("status", run, "--json", cwd=workspace).stdout)
    assert st["state"] == "cancelled" and st["cancelled_by"] == "v4launch cancel"
    assert st["step"] == step and st["checkpoint"] == str(ckpt)
    human = v4launch("status", run, cwd=workspace)
    assert human.returncode == 0 and "run state: cancelled" in human.stdout and f"step {step}" in human.stdout
