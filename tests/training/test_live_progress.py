"""Live progress of a multi-process local run (issue 42): one bar per stage drawn from rank 0's metrics.jsonl and its
per-step logs/progress.rank0.json, with totals from the stage plan that follow a resume or phase jump, and an ETA
from a moving average of step times."""

from __future__ import annotations

import io
import json
import os
import pty
import re
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
    assert clock.seconds_per_step == pytest.approx(0.5)  # the slow interval has left the 20-step window
    clock.add(70, 99.0)  # the same step again (read from both files): ignored
    assert clock.seconds_per_step == pytest.approx(0.5)
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


def test_bars_move_at_every_step_from_the_per_step_record(tmp_path):
    """Steps between logged ones reach the bars through logs/progress.rank0.json as the job writes it; a stale
    file from an earlier launch is not drawn; a stage's last logged record read late still completes its bar."""
    from v4launch.training.metrics import MetricsLogger

    (tmp_path / "logs").mkdir()
    step_file = tmp_path / "logs" / "progress.rank0.json"
    step_file.write_text(json.dumps({**rec(0, "old", "dense", 7, 7, 3.5), "stage_steps": 9}))  # earlier launch
    live = LiveProgress(tmp_path / "metrics.jsonl", {0: 6, 1: 4}, console=Console(file=io.StringIO(), width=150))
    logger = MetricsLogger(tmp_path, rank=0, total_steps=10, tensorboard=False, progress=False)
    live.poll()
    assert live.bars() == {}
    plans = {0: 6, 1: 4}
    for step, (stage, k) in enumerate([(0, 1), (0, 2), (0, 3)], start=1):
        logger.step(dict(rec(stage, "dense_512", "dense", step, k, step * 0.5), **FULL), first_step_this_job=0,
                    show=step == 1, stage_steps=plans[stage])
        live.poll()
        assert live.bars()["dense_512"] == (k, 6)  # every step, logged (step 1) or not
    written = json.loads(step_file.read_text())
    assert (written["step"], written["stage_steps"], written["lm_loss"], written["elapsed_s"]) == (3, 6, 3.0, 1.5)
    for step, (stage, name, k) in enumerate([(0, "dense_512", 4), (0, "dense_512", 5), (0, "dense_512", 6),
                                             (1, "warmup_512", 1)], start=4):
        logger.step(dict(rec(stage, name, "warmup" if stage else "dense", step, k, step * 0.5), **FULL),
                    first_step_this_job=0, show=k == 6, stage_steps=plans[stage])
    live.poll()  # steps 4 and 5 were never seen; step 6 (logged, the stage's last) and step 7's record were
    logger.close()
    assert live.bars() == {"dense_512": (6, 6), "warmup_512": (1, 4)}
    assert live.clock.seconds_per_step == pytest.approx(0.5)


FULL = {"aux": {}, "aux_sum": {}, "aux_weighted": {}, "total_loss": 3.0, "grad_norm": 1.0, "lr": 1e-3, "muon_lr": 0.0}


def test_an_in_process_run_draws_the_same_bars_per_stage(tmp_path, monkeypatch):
    """World size 1 trains in the launcher's process: its MetricsLogger draws one bar per stage on a terminal, with
    the stage's own total (not the curriculum's), at every step."""
    from v4launch.training.metrics import MetricsLogger

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    logger = MetricsLogger(tmp_path, rank=0, total_steps=10, tensorboard=False, progress=True)
    for step, (stage, name, k) in enumerate([(0, "dense_512", 1), (0, "dense_512", 2), (2, "sparse_2k", 1)], 1):
        logger.step(dict(rec(stage, name, "sparse" if stage else "dense", step, k, step * 0.5), **FULL),
                    first_step_this_job=0, show=False, stage_steps={0: 6, 2: 3}[stage])
    bars = logger._progress.bars()
    logger.close()
    assert bars == {"dense_512": (2, 6), "sparse_2k": (1, 3)}
    assert "sparse_2k" in sys.stdout.getvalue() and "1/3" in sys.stdout.getvalue()


def test_summary_lines_are_left_to_the_bars():
    assert SUMMARY_LINE.match("12:00:01 step 10/150 dense_512 (dense) lm 3.1 kl - bal - mtp -")
    assert not SUMMARY_LINE.match("12:00:01 checkpoint step_00000050 saved")


FLASH_DEBUG = Path(__file__).resolve().parents[2] / "recipes" / "flash_debug.yaml"
SMALL = ("curriculum.stages.0.steps=2", "curriculum.stages.1.steps=4", "curriculum.stages.2.steps=3",
         "curriculum.stages.0.seq_len=128", "curriculum.stages.1.seq_len=128", "curriculum.stages.2.seq_len=256",
         "data.max_documents=200", "logging.interval_steps=100", "logging.tensorboard=false", "logging.plot=false")
"""flash_debug's layout (4 workers: pp 2 x vpp 2, ep 2, FSDP, then a cp 2 stage) with 9 short steps; only each
stage's first and last step logged, so the bars' other positions come from the per-step record."""


def through_terminal(args: list[str], cwd: Path, timeout_s: float) -> tuple[int, str]:
    """Run ``v4launch ARGS`` on a pseudo-terminal, as a user sees it: (exit code, everything it drew)."""
    exe = str(Path(sys.executable).with_name("v4launch"))
    main, child = pty.openpty()
    proc = subprocess.Popen([exe, *args], cwd=cwd, stdin=child, stdout=child, stderr=child,
                            env=dict(os.environ, COLUMNS="160", OMP_NUM_THREADS="1", TERM="xterm"))
    os.close(child)
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 1.0)
        if ready:
            try:
                data = os.read(main, 65536)
            except OSError:  # the terminal closed: the command ended
                break
            if not data:
                break
            chunks.append(data.decode(errors="replace"))
        elif proc.poll() is not None:
            break
    proc.wait(timeout=60)
    os.close(main)
    return proc.returncode, "".join(chunks)


def bar(screen: str, stage: str) -> str:
    """The last drawn state of ``stage``'s bar: its ``done/total`` column (colours stripped)."""
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    drawn = re.findall(rf"{stage} \w+ +[━╺╸ ]+ (\d+/\d+) ", plain)
    assert drawn, f"no bar of {stage} in: {plain[-3000:]}"
    return drawn[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_flash_debug_shows_bars_on_a_terminal_with_the_right_total_after_a_phase_jump(workspace):
    """`v4launch run recipes/flash_debug.yaml` (four workers) through a pseudo-terminal, stopped 3 steps into the
    4-step warm-up; then `resume --phase sparse` skips the rest of the warm-up: the sparse bar counts that stage's
    own 3 steps (the run's step counter reads 6 of 9 at its end)."""
    rc, screen = through_terminal(["run", str(FLASH_DEBUG), *SMALL, "--max-steps", "5"], workspace, 140)
    assert rc == 0, screen[-3000:]
    assert bar(screen, "dense_512") == "2/2", screen[-3000:]
    assert bar(screen, "warmup_512") == "3/4", screen[-3000:]  # step 5: not logged, drawn from the per-step record
    assert "━" in screen and "eta" in screen  # rich's bar, with the ETA column
    assert not SUMMARY_LINE.search(screen.replace("\r", "\n"))  # the bars replace the plain step lines
    rc, screen = through_terminal(["resume", "--phase", "sparse"], workspace, 140)
    assert rc == 0, screen[-3000:]
    assert bar(screen, "sparse_1k") == "3/3", screen[-3000:]
    assert "warmup_512 warmup" not in screen  # no bar for the stage the jump skipped
