"""Live progress of a multi-process local run (issue 42): one bar per stage drawn from rank 0's metrics.jsonl, with
totals from the stage plan that follow a resume or phase jump, and an ETA from a moving average of step times."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from v4launch.live_progress import SUMMARY_LINE, LiveProgress, StepClock, eta_text


def rec(stage_index, stage, phase, step, in_stage, elapsed, loss=3.0):
    return {"kind": "train", "stage_index": stage_index, "stage": stage, "phase": phase, "step": step,
            "step_in_stage": in_stage, "elapsed_s": elapsed, "lm_loss": loss, "tokens_per_s": 2048.0}


def test_the_eta_follows_recent_step_times_not_the_slow_first_steps():
    clock = StepClock()
    clock.add(1, 30.0)  # the first step: 30 s of start-up
    clock.add(10, 42.0)  # 12 s for 9 steps: caches still warming
    assert clock.seconds_per_step == pytest.approx(12 / 9)
    for step in range(20, 80, 10):  # then 0.5 s per step
        clock.add(step, 42.0 + (step - 10) * 0.5)
    assert clock.seconds_per_step == pytest.approx(0.5)  # the slow interval has left the 5-interval window
    assert eta_text(0.5 * 110) == "0m55s" and eta_text(7380) == "2h03m" and eta_text(None) == "-"


def test_bars_per_stage_follow_a_phase_jump(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(rec(0, "dense_512", "dense", 50, 50, 25.0)) + "\n")  # before this launch: not read
    out = io.StringIO()
    live = LiveProgress(metrics, {0: 80, 1: 40, 2: 30}, console=Console(file=out, force_terminal=True, width=150))
    with metrics.open("a") as f:  # resumed mid-warm-up at step 90, then `resume --phase sparse` jumped to stage 2
        for step, k in ((91, 11), (100, 20)):
            f.write(json.dumps(rec(1, "warmup_512", "warmup", step, k, step * 0.5)) + "\n")
        f.write(json.dumps(rec(2, "sparse_2k", "sparse", 101, 1, 50.5)) + "\n")
        f.write('{"kind": "train", "stage_index": 2, "step_in')  # a record being written: waits
    live.poll()
    assert live.bars() == {"warmup_512": (20, 40), "sparse_2k": (1, 30)}
    with metrics.open("a") as f:
        f.write('_stage": 10, "stage": "sparse_2k", "phase": "sparse", "step": 110, "elapsed_s": 55.0, '
                '"lm_loss": 2.5, "tokens_per_s": 2048.0}\n')
    live.stop()
    assert live.bars()["sparse_2k"] == (10, 30)
    shown = out.getvalue()
    assert "sparse_2k" in shown and "10/30" in shown and "eta 0m10s" in shown  # 20 steps left at 0.5 s/step
    assert "lm 2.500" in shown


def test_summary_lines_are_left_to_the_bars():
    assert SUMMARY_LINE.match("12:00:01 step 10/150 dense_512 (dense) lm 3.1 kl - bal - mtp -")
    assert not SUMMARY_LINE.match("12:00:01 checkpoint step_00000050 saved")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_two_worker_run_shows_bars_on_a_terminal(workspace, write_recipe):
    """Through a pseudo-terminal, as a user sees `v4launch run` of a 2-process recipe."""
    recipe = write_recipe(over={"cluster": {"gpus_per_node": 2}, "logging": {"interval_steps": 1}})
    exe = str(Path(sys.executable).with_name("v4launch"))
    main, child = pty.openpty()
    proc = subprocess.Popen([exe, "run", str(recipe)], cwd=workspace, stdin=child, stdout=child, stderr=child,
                            env=dict(os.environ, COLUMNS="160", OMP_NUM_THREADS="1", TERM="xterm"))
    os.close(child)
    chunks, deadline = [], time.monotonic() + 380
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                data = os.read(main, 65536)
            except OSError:  # the terminal closed: the run ended
                break
            if not data:
                break
            chunks.append(data.decode(errors="replace"))
        elif proc.poll() is not None:
            break
    proc.wait(timeout=60)
    os.close(main)
    screen = "".join(chunks)
    assert proc.returncode == 0, screen[-3000:]
    for name, steps in (("dense", 3), ("warm", 3), ("sparse", 2)):
        assert f"{steps}/{steps}" in screen and name in screen, screen[-3000:]
    assert "━" in screen and "eta" in screen  # rich's bar, with the ETA column
    assert not SUMMARY_LINE.search(screen.replace("\r", "\n"))  # the bars replace the plain step lines
