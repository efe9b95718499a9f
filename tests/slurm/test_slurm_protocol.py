"""The requeue protocol on the real dev cluster, with the fast stand-in train: time limit,
restart budget and cancel. (Real training through `v4launch submit`: test_slurm_train.py.)"""

from __future__ import annotations

import subprocess

import pytest

from slurm_helpers import cli, diagnostics, finished, events, ledger, queue_empty, signal_job, submit_standin, train_records, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

FAST = ["cluster.gpus_per_node=1", "slurm.cpus_per_task=1", "checkpointing.interval_steps=5", "curriculum.stages.1.steps=2",
        "curriculum.stages.2.steps=2"]


def _steps(run_dir):
    return [r["step"] for r in train_records(run_dir)]


def test_time_limit_checkpoints_requeues_and_finishes(workspace):
    # 1-minute limit, USR2 45 s before it; the stand-in needs ~75 s for stage 0: time-limit requeues. Slurm checks
    # time limits periodically (not at the second), so the signal lands some seconds after t = 15 s; with 30 s
    # before the limit and a 50 s stage 0, a fresh-clone run once finished stage 0 before any USR2 came.
    run_dir, job = submit_standin([*FAST, "curriculum.stages.0.steps=150", "slurm.time_min=1",
                                   "slurm.signal_delay_s=45", "slurm.max_restarts=10"])
    wait_for("the run to finish", lambda: finished(run_dir), 600, run_dir)
    assert events(run_dir, "completed"), diagnostics(run_dir)
    # Some requeue is a checkpointed time-limit stop. Not necessarily the first: on a loaded machine the
    # job's start-up can outlast the 30 s before USR2 (Slurm counts from the allocation), and a signal
    # that lands before training starts is requeued by submitit with nothing to save.
    requeues = events(run_dir, "requeue")
    assert any("time limit (USR2)" in r["detail"] for r in requeues), diagnostics(run_dir)
    steps = _steps(run_dir)
    assert sorted(set(steps)) == list(range(1, 155))  # nothing skipped
    for stop in events(run_dir, "signal"):  # checkpointed at the stop: nothing lost, nothing repeated
        assert steps.count(stop["step"]) == 1 and steps.count(stop["step"] + 1) <= 1, stop
    assert len(events(run_dir, "submit")) == 3  # one job per stage
    assert events(run_dir, "restart")


def test_signal_requeues_are_segments_not_failures_and_the_segment_cap_stops_a_loop(workspace):
    # max_restarts=0: a failure would stop the run at once; a checkpointed requeue is a planned segment and goes on
    run_dir, job = submit_standin([*FAST, "curriculum.stages.0.steps=400", "slurm.max_restarts=0",
                                   "slurm.max_segments=2"])
    for n in (1, 2):
        wait_for(f"attempt {n} to make progress",
                 lambda: [r for r in train_records(run_dir) if r["restart"] == str(n - 1) and r["step"] >= 2], 240,
                 run_dir)
        signal_job(job, "usr2")
        wait_for(f"attempt {n} to handle the signal", lambda: len(events(run_dir, "signal")) >= n, 120, run_dir)
    wait_for("the job to leave the queue", lambda: queue_empty(run_dir), 120, run_dir)
    (exhausted,) = events(run_dir, "budget_exhausted")
    assert "slurm.max_segments=2" in exhausted["detail"]
    (requeued,) = [e for e in events(run_dir, "requeue")]
    assert "segment 2 of at most 2" in requeued["detail"], requeued
    status = cli("status", "--json", cwd=workspace)
    assert status.returncode == 1, status.stderr
    assert '"state": "failed"' in status.stdout and "RestartBudgetExhausted" in status.stdout


def test_cancel_checkpoints_and_stops_every_job(workspace):
    run_dir, job = submit_standin([*FAST, "curriculum.stages.0.steps=400"])
    wait_for("training to start", lambda: len(train_records(run_dir)) >= 3, 240, run_dir)
    out = cli("cancel", cwd=workspace)
    assert out.returncode == 0, out.stderr
    assert f"Slurm job(s) {job}" in out.stdout
    wait_for("the job to stop", lambda: queue_empty(run_dir), 120, run_dir)
    (stopped,) = [e for e in events(run_dir, "exit") if "cancelled" in e["detail"]]
    assert stopped["step"] == _steps(run_dir)[-1]  # checkpointed at the step it stopped on
    assert not events(run_dir, "requeue")
    status = cli("status", cwd=workspace)
    assert status.returncode == 0 and "run state: cancelled" in status.stdout, status.stdout
    again = cli("cancel", cwd=workspace)
    assert again.returncode == 1 and "no queued or running" in again.stderr


def test_plain_scancel_is_never_undone_by_a_requeue(workspace):
    run_dir, job = submit_standin([*FAST, "curriculum.stages.0.steps=400"])
    wait_for("training to start", lambda: len(train_records(run_dir)) >= 2, 240, run_dir)
    subprocess.run(["scancel", job], check=True, timeout=30)
    wait_for("the job to stop", lambda: queue_empty(run_dir), 120, run_dir)
    (stopped,) = events(run_dir, "exit")
    assert stopped["detail"].startswith("cancelled (SIGTERM)") and not events(run_dir, "requeue")


def test_sigterm_without_the_user_signal_checkpoints_and_requeues(workspace):
    run_dir, job = submit_standin([*FAST, "curriculum.stages.0.steps=60"])
    wait_for("training to start", lambda: len(train_records(run_dir)) >= 2, 240, run_dir)
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
    wait_for("the run to finish", lambda: finished(run_dir), 300, run_dir)
    assert events(run_dir, "completed"), diagnostics(run_dir)
    (requeue,) = events(run_dir, "requeue")
    assert "(SIGTERM)" in requeue["detail"]
    steps = _steps(run_dir)
    assert sorted(set(steps)) == list(range(1, 65)) and len(steps) == len(set(steps))
