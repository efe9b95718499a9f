"""Issue 21 on the real dev cluster, with the fast stand-in train: a stop notice that lands after a
stage finished does not fail the job, a requeued job's status says why it was requeued, and `logs`
shows a job's stdout and stderr in the order they were written."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from slurm_helpers import cli, diagnostics, events, finished, ledger, signal_job, submit_standin, train_records, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

FAST = ["cluster.gpus_per_node=1", "slurm.cpus_per_task=1", "checkpointing.interval_steps=5",
        "curriculum.stages.1.steps=2", "curriculum.stages.2.steps=2"]


def sacct_state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True,
                         timeout=30).stdout.split()
    return out[-1] if out else "UNKNOWN"


def test_a_stop_notice_after_the_stage_finished_does_not_fail_the_job(workspace, monkeypatch):
    monkeypatch.setenv("STANDIN_LATE_USR2", "1")  # the stand-in signals itself once its stage is done
    run_dir, job = submit_standin([*FAST, "curriculum.stages.0.steps=3"])
    wait_for("the run to finish", lambda: finished(run_dir), 420, run_dir)
    assert events(run_dir, "completed"), diagnostics(run_dir)
    assert not events(run_dir, "requeue") and not events(run_dir, "restart"), diagnostics(run_dir)
    jobs = [e["job_id"] for e in events(run_dir, "submit")]
    assert len(jobs) == 3
    for j in jobs[:2]:  # the stage jobs that finished under a stream of USR2
        assert [e["event"] for e in ledger(run_dir) if e["job_id"] == j] == ["submit", "start", "stage_completed"]
    deadline = time.monotonic() + 60  # accounting may lag the queue a little
    while time.monotonic() < deadline and any(sacct_state(j) != "COMPLETED" for j in jobs):
        time.sleep(2)
    assert [sacct_state(j) for j in jobs] == ["COMPLETED"] * 3, diagnostics(run_dir)
    # one log per job, stdout and stderr in the order written (not all of stderr after stdout)
    logs = cli("logs", str(run_dir), cwd=workspace).stdout.splitlines()
    for step in (1, 2):
        out, err = logs.index(f"standin step {step} stdout"), logs.index(f"standin step {step} stderr")
        assert out < err < logs.index(f"standin step {step + 1} stdout"), "\n".join(logs)


def test_a_requeued_job_says_why_while_it_waits(workspace):
    run_dir, job = submit_standin([*FAST, "curriculum.stages.0.steps=200"])
    wait_for("training to start", lambda: len(train_records(run_dir)) >= 2, 240, run_dir)
    signal_job(job, "usr2")
    wait_for("the requeue", lambda: events(run_dir, "requeue"), 120, run_dir)
    seen = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not events(run_dir, "restart"):
        st = json.loads(cli("status", "--json", cwd=workspace).stdout)
        seen += [j["detail"] for j in st["jobs"] if j["job_id"] == job and j["state"] == "requeued"]
        time.sleep(0.5)
    assert seen, diagnostics(run_dir)
    assert all(d.startswith("requeue: preemption (USR2): checkpoint saved, requeued") for d in seen), seen
    subprocess.run(["scancel", job], timeout=30)
    wait_for("the job to leave the queue", lambda: finished(run_dir), 120, run_dir)
