"""`v4launch submit` with the real training job on the dev cluster: the whole curriculum,
preemption (USR2 notice and `scontrol requeue`) resuming from the checkpoint, and a crash."""

from __future__ import annotations

import json

import pytest
from slurm_helpers import (QUICK, REPO, cli, diagnostics, events, finished, ledger, signal_job, train_records,
                           wait_for)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

TINY = str(REPO / "recipes" / "tiny_cpu.yaml")


def submit(workspace, *overrides):
    out = cli("submit", TINY, "--nodes", "1", "--allow-dirty", "--json", *QUICK, *overrides, cwd=workspace)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    return workspace.joinpath(info["run_dir"]).resolve(), info["job_id"]


def steps(run_dir):
    return [r["step"] for r in train_records(run_dir)]


def test_submit_runs_the_whole_curriculum(workspace):
    run_dir, job = submit(workspace, "curriculum.stages.0.steps=2", "curriculum.stages.1.steps=1",
                          "curriculum.stages.2.steps=1")
    wait_for("the curriculum to finish", lambda: finished(run_dir), 900, run_dir)
    assert events(run_dir, "completed"), diagnostics(run_dir)
    assert [e["stage"] for e in events(run_dir, "submit")] == [0, 1, 2]  # one job per stage, chained
    assert steps(run_dir) == [1, 2, 3, 4]
    run_json = json.loads((run_dir / "run.json").read_text())
    assert run_json["launcher"] == "slurm" and run_json["extra"]["code"]["git_sha"]
    status = cli("status", "--json", cwd=workspace)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["state"] == "completed" and len(st["jobs"]) == 3 and st["checkpoint"]
    assert [j["state"] for j in st["jobs"]] == ["stage completed", "stage completed", "completed"]
    table = cli("status", cwd=workspace)
    assert "run state: completed" in table.stdout and st["jobs"][2]["stage"] in table.stdout
    logs = cli("logs", str(run_dir), cwd=workspace)
    assert logs.returncode == 0 and f"==> job {job} <==" in logs.stdout and "step 4/4" in logs.stdout


def test_preemption_checkpoints_requeues_and_resumes(workspace):
    run_dir, job = submit(workspace, "curriculum.stages.0.steps=40", "curriculum.stages.1.steps=1",
                          "curriculum.stages.2.steps=1")
    # 1) the checkpoint signal submitit asks Slurm for (USR2): stop after the step, save, requeue
    wait_for("two training steps", lambda: len(steps(run_dir)) >= 2, 600, run_dir)
    signal_job(job, "usr2")
    wait_for("the USR2 stop", lambda: events(run_dir, "signal"), 300, run_dir)
    stop1 = events(run_dir, "signal")[0]["step"]
    wait_for("the restart to train past the stop", lambda: max(steps(run_dir)) > stop1 + 2, 600, run_dir)
    # 2) an administrator's requeue (SIGTERM): Slurm requeues, the job saves within KillWait
    before = max(steps(run_dir))
    signal_job(job, "requeue")
    wait_for("the run to finish", lambda: finished(run_dir), 900, run_dir)
    assert events(run_dir, "completed"), diagnostics(run_dir)
    trace = steps(run_dir)
    assert sorted(set(trace)) == list(range(1, 43))
    after_first = trace[trace.index(stop1) + 1]
    assert after_first == stop1 + 1  # resumed from the stop checkpoint: no step lost or repeated
    assert max(trace[:trace.index(before) + 1]) == before
    assert len(trace) - len(set(trace)) <= 2  # at most checkpointing.interval_steps steps redone (SIGTERM)
    requeues = events(run_dir, "requeue")
    assert len(requeues) == 2 and "preemption (USR2)" in requeues[0]["detail"], diagnostics(run_dir)
    assert len(events(run_dir, "restart")) == 2
    st = json.loads(cli("status", "--json", cwd=workspace).stdout)
    assert st["state"] == "completed" and st["restarts"] == 2
    assert st["jobs"][0]["restarts"] == 2 and st["jobs"][0]["state"] == "stage completed"


def test_a_crash_is_reported_failed_with_its_log_tail(workspace):
    run_dir, job = submit(workspace, "data.source=files", "data.paths=[/nonexistent/corpus]")
    wait_for("the job to end", lambda: finished(run_dir), 600, run_dir)
    (failed,) = events(run_dir, "failed")
    assert "does not exist" in failed["detail"] and not events(run_dir, "requeue")
    status = cli("status", "--json", cwd=workspace)
    assert status.returncode == 1
    st = json.loads(status.stdout)
    assert st["state"] == "failed" and any("/nonexistent/corpus" in line for line in st["log_tail"])
    human = cli("status", cwd=workspace)
    assert "failed" in human.stdout and "last lines of" in human.stdout
    assert "nonexistent" in cli("logs", cwd=workspace).stdout
    assert [e["event"] for e in ledger(run_dir)] == ["submit", "start", "failed"]


def test_two_ranks_rendezvous_and_stop_together(workspace):
    """Two tasks on the node (gloo): MASTER_ADDR from the allocation, a USR2 reaches every rank, both
    save, rank 0 requeues, and the restarted pair resumes from the same checkpoint."""
    run_dir, job = submit(workspace, "cluster.gpus_per_node=2", "parallel.global_batch_size=2",
                          "slurm.master_port=29611", "curriculum.stages.0.steps=30", "curriculum.stages.1.steps=1",
                          "curriculum.stages.2.steps=1")
    wait_for("three steps on two ranks", lambda: len(steps(run_dir)) >= 3, 600, run_dir)
    signal_job(job, "usr2")
    wait_for("the run to finish", lambda: finished(run_dir), 900, run_dir)
    assert events(run_dir, "completed"), diagnostics(run_dir)
    trace = steps(run_dir)
    stop = events(run_dir, "signal")[0]["step"]
    assert sorted(set(trace)) == list(range(1, 33)) and trace.count(stop + 1) == 1
    rank1 = (run_dir / "logs" / "rank1.log").read_text()
    assert f"stopped at step {stop}" in rank1 and "world 2" in rank1
    assert (run_dir / "slurm" / f"{job}_1_log.out").exists()
