"""The requeue state machine, the ledger and the rendezvous environment (no cluster needed)."""

from __future__ import annotations

import os
import pickle
import threading

import pytest

from v4launch.errors import V4LaunchError
from v4launch.slurm import ledger
from v4launch.slurm.job import SlurmTrainJob
from v4launch.slurm.ledger import Event
from v4launch.slurm.query import clean_submit_env
from v4launch.slurm.rendezvous import expand_nodelist, rendezvous_env
from v4launch.slurm.states import (Decision, after_stop, job_state, normalise, on_start, parse_duration,
                                   requeue_outcome, run_state)


def ev(event, job="7", detail=""):
    return Event(time="t", job_id=job, event=event, detail=detail)


# ------------------------------------------------------------------ job states
@pytest.mark.parametrize("slurm, events, shown", [
    ("PREEMPTED", [], "preempted"),                     # never "failed" (submitit PR #1770)
    ("REQUEUED", [], "requeued"),
    ("PENDING", [ev("start"), ev("requeue")], "requeued"),
    ("RUNNING", [ev("start"), ev("requeue")], "requeued"),  # requeued itself, being killed
    ("PENDING", [ev("submit")], "pending"),
    ("RUNNING", [ev("start")], "running"),
    ("RUNNING", [ev("start"), ev("completed")], "completed"),  # still exiting
    ("COMPLETED", [ev("stage_completed")], "stage completed"),
    ("TIMEOUT", [ev("start"), ev("requeue")], "requeued"),
    ("TIMEOUT", [ev("start")], "timeout"),
    ("NODE_FAIL", [ev("start")], "node failure"),
    ("FAILED", [ev("start")], "failed"),
    ("OUT_OF_MEMORY", [], "failed"),
    ("COMPLETED", [ev("start"), ev("failed")], "failed"),
    ("FAILED", [ev("budget_exhausted")], "failed"),
    ("CANCELLED by 0", [ev("start")], "cancelled"),
    ("CANCELLED", [ev("exit", detail="cancelled (SIGTERM)")], "cancelled"),
    ("COMPLETED", [ev("exit", detail="max_steps=3 reached")], "stopped"),
    (None, [], "unknown"),
])
def test_job_state(slurm, events, shown):
    assert job_state(slurm, events) == shown


def test_normalise_and_run_state():
    assert normalise("CANCELLED by 0") == normalise("CANCELLED+") == "CANCELLED"
    assert run_state(["stage completed", "running"]) == "running"
    assert run_state(["stage completed", "requeued"]) == "requeued"
    assert run_state(["stage completed", "failed"]) == "failed"
    assert run_state([]) == "not launched"


# ------------------------------------------------------------------ decisions after a stop
def stop(signal="USR2", state="RUNNING", segments=0, cap=None, cancel=False, left=3600):
    return after_stop(signal, state, segments, cap, cancel=cancel, time_left_s=left, signal_delay_s=120)


def test_preemption_notice_requeues():
    d = stop()
    assert (d.action, d.event) == ("requeue", "requeue") and "preemption (USR2)" in d.detail


def test_time_limit_is_told_apart_from_preemption():
    assert "time limit" in stop(left=100).detail and "preemption" in stop(left=1000).detail
    assert "time limit" in stop("SIGTERM", state="TIMEOUT", left=None).detail


def test_cancel_never_requeues():
    assert stop(cancel=True).action == "exit" and stop("SIGTERM", state="CANCELLED").action == "exit"
    assert "cancelled" in stop(cancel=True).detail


def test_slurm_already_requeueing_is_left_alone():
    for state in ("PENDING", "REQUEUED"):
        d = stop("SIGTERM", state=state)
        assert (d.action, d.event) == ("leave", "requeue")


def test_an_unexplained_kill_is_not_undone():
    d = stop("SIGTERM", state="COMPLETING")
    assert (d.action, d.event) == ("exit", "exit") and "not requeued" in d.detail
    assert stop("SIGTERM", state="COMPLETING", left=0).action == "requeue"  # at the limit: a time limit


def test_timeout_and_preempted_states_requeue():
    assert "time limit (SIGTERM)" in stop("SIGTERM", state="TIMEOUT").detail
    assert stop("SIGTERM", state="PREEMPTED").action == "requeue" and stop("USR2", state=None).action == "requeue"


def test_time_limit_requeues_are_planned_segments_without_a_cap():
    # a multi-week stage in 4-hour jobs: the 500th time limit is requeued like the first (issue 41)
    for used in (0, 5, 499):
        d = stop(segments=used, left=100)
        assert (d.action, d.event) == ("requeue", "requeue") and d.detail.startswith("time limit (USR2)")
        assert f"segment {used + 2} of this stage" in d.detail and "max_restarts" not in d.detail


def test_the_segment_cap_stops_the_stage_after_its_last_segment():
    assert stop(segments=3, cap=5).action == "requeue" and "segment 5 of at most 5" in stop(segments=3, cap=5).detail
    d = stop(segments=4, cap=5)  # the 5th job of the stage ends: no 6th
    assert (d.action, d.event) == ("exit", "budget_exhausted") and "slurm.max_segments=5" in d.detail
    assert stop(segments=0, cap=1).event == "budget_exhausted"
    assert stop(segments=9, cap=5, cancel=True).event == "exit"  # a cancel is a cancel


def test_segment_requeues_do_not_use_the_failure_budget():
    planned = [ev("start"), ev("requeue", detail="time limit (USR2): checkpoint saved, requeued (segment 2 of this stage)"),
               ev("restart"), ev("requeue", detail="preemption (SIGTERM): requeued by Slurm; checkpoint saved")]
    assert ledger.restarts_used(planned) == 0 and ledger.segments_used(planned) == 2
    assert [e for e, _ in on_start(2, planned, "7", 0)] == ["restart"]  # max_restarts=0 and still trains
    failed = [*planned, ev("restart")]  # then killed without its handler: Slurm restarts it, a failure
    out = on_start(3, failed, "7", 0)
    assert [e for e, _ in out] == ["requeue", "budget_exhausted"] and "slurm.max_restarts=0" in out[-1][1]
    assert [e for e, _ in on_start(3, failed, "7", 1)] == ["requeue", "restart"]


def test_requeue_outcome():
    d = Decision("requeue", "requeue", "preemption (SIGTERM): checkpoint saved, requeued (segment 2 of this stage)")
    assert requeue_outcome(d, None) == d
    assert requeue_outcome(d, "Job is pending execution for job 7").detail.count("requeued by Slurm") == 1
    failed = requeue_outcome(d, "Access/permission denied")
    assert (failed.action, failed.event) == ("exit", "exit") and "permission" in failed.detail


# ------------------------------------------------------------------ on start
def test_first_start():
    assert on_start(0, [], "7", 5) == [("start", "")]


def test_restart_after_our_requeue():
    out = on_start(1, [ev("start"), ev("requeue")], "7", 5)
    assert [e for e, _ in out] == ["restart"]


def test_restart_after_a_kill_counts_as_a_requeue():
    out = on_start(1, [ev("start")], "7", 5)
    assert [e for e, _ in out] == ["requeue", "restart"]


def test_restart_over_budget_does_not_train():
    events = [ev("start"), ev("requeue"), ev("restart"), ev("requeue")]
    assert [e for e, _ in on_start(2, events, "7", 1)] == ["budget_exhausted"]


def test_requeued_after_it_ended_does_not_train():
    out = on_start(1, [ev("start"), ev("stage_completed")], "7", 5)
    assert [e for e, _ in out] == ["exit"]


@pytest.mark.parametrize("text, seconds", [("0:25", 25), ("1:02:03", 3723), ("1-00:00:10", 86410),
                                           ("UNLIMITED", None), ("INVALID", None), ("", None)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


# ------------------------------------------------------------------ ledger
def test_ledger_roundtrip_and_queries(tmp_path):
    ledger.append(tmp_path, "5", "submit", stage=0)
    ledger.append(tmp_path, "5", "start")
    ledger.append(tmp_path, "5", "requeue", stage=0, step=12, detail="preemption")
    ledger.append(tmp_path, "5", "requeue", stage=0, detail="requeued by Slurm without a checkpoint signal")
    ledger.append(tmp_path, "6", "submit", stage=1)
    ledger.append(tmp_path, "6", "requeue", stage=1, detail="time limit (USR2): checkpoint saved")
    ledger.append(tmp_path, "6", "cancel")
    (tmp_path / "ledger.jsonl").open("a").write("{half a line\n")
    events = ledger.read(tmp_path)
    assert ledger.job_ids(events) == ["5", "6"] and ledger.restarts_used(events) == 1  # the one without a signal
    assert ledger.segments_used(events) == 2 and ledger.segments_used(events, 1) == 1
    assert ledger.cancel_requested(events, "6") and not ledger.cancel_requested(events, "5")
    assert [e.event for e in ledger.for_job(events, "5")] == ["submit", "start", "requeue", "requeue"]
    assert events[2].step == 12 and events[2].stage == 0


def test_ledger_rejects_unknown_events(tmp_path):
    with pytest.raises(ValueError, match="unknown ledger event"):
        ledger.append(tmp_path, "1", "exploded")


def test_ledger_appends_from_many_writers(tmp_path):
    def write(n):
        for i in range(50):
            ledger.append(tmp_path, str(n), "signal", step=i, detail="x" * 500)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ledger.read(tmp_path)) == 400


# ------------------------------------------------------------------ rendezvous
TASK = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-08,10],login3",
        "MASTER_ADDR": "stale-host", "RANK": "99"}


def test_rendezvous_env_from_the_task():
    env = rendezvous_env(TASK, 29511, hostnames=["gpu07", "gpu08", "gpu10", "login3"])
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "2",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": "29511"}


def test_nodelist_expansion_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert expand_nodelist("gpu[07-08,10],login3") == ["gpu07", "gpu08", "gpu10", "login3"]
    assert rendezvous_env(TASK, 29500)["MASTER_ADDR"] == "gpu07"  # first node, never the inherited one


def test_rendezvous_outside_slurm_is_a_clear_error():
    with pytest.raises(V4LaunchError, match="not inside a Slurm task"):
        rendezvous_env({}, 29500)


def test_rendezvous_inconsistent_counts():
    with pytest.raises(V4LaunchError, match="inconsistent"):
        rendezvous_env({**TASK, "SLURM_NTASKS": "7"}, 29500, hostnames=["a", "b", "c", "d"])


def test_clean_submit_env_drops_the_jobs_own_variables():
    env = clean_submit_env({**TASK, "SLURM_CONF": "/etc/slurm/slurm.conf", "SUBMITIT_FOLDER": "x", "PATH": "/bin",
                            "WORLD_SIZE": "8"})
    assert env == {"SLURM_CONF": "/etc/slurm/slurm.conf", "PATH": "/bin"}


# ------------------------------------------------------------------ the pickled job
def test_requeued_callable_carries_no_stale_checkpoint(tmp_path):
    job = SlurmTrainJob(tmp_path, max_steps=9)
    job.last_checkpoint = tmp_path / "checkpoints" / "step_00000002"  # state a job might have picked up
    fresh = job.checkpoint().function
    assert isinstance(fresh, SlurmTrainJob) and fresh is not job
    assert vars(fresh) == {"run_dir": str(tmp_path), "max_steps": 9, "entry": "v4launch.training.job:train"}
    assert b"step_00000002" not in pickle.dumps(fresh)


def test_pending_reasons_from_squeue(tmp_path, monkeypatch):
    """`status` says why a job waits: squeue's %r for pending jobs, in words where it is common."""
    from v4launch.slurm import query

    fake = tmp_path / "squeue"
    fake.write_text("#!/bin/sh\n"
                    "echo \"$@\" > \"$(dirname \"$0\")/args\"\n"
                    "printf '101|Resources\\n102|(PartitionTimeLimit)\\n103|None\\n104|Weird_Reason\\n999|Priority\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    got = query.pending_reasons(["101", "102", "103", "104"])
    assert got["101"] == "Resources: waiting for nodes / GPUs to become free"
    assert got["102"].startswith("(PartitionTimeLimit): slurm.time_min is above the partition's time limit")
    assert "103" not in got and got["104"] == "Weird_Reason" and "999" not in got  # not asked for
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-t") + 1] == "PENDING" and args[args.index("-j") + 1] == "101,102,103,104"
    assert query.pending_reasons([]) == {}


# ------------------------------------------------------------------ issue 21: labels and status lines
def test_time_limit_label_comes_from_slurms_record_at_the_catch():
    # Slurm may send USR2@120 up to 60 s early: caught 170 s before EndTime is the time-limit notice,
    # however long the step and the save took afterwards
    assert "time limit (USR2)" in stop(left=170).detail
    assert "preemption (USR2)" in stop(left=190).detail
    # a job Slurm marked for preemption is a preemption even close to its time limit
    d = after_stop("USR2", "RUNNING", 0, 5, cancel=False, time_left_s=100, signal_delay_s=120, preempted=True)
    assert "preemption (USR2)" in d.detail and d.action == "requeue"
    assert "preemption" in stop("SIGTERM", state="PREEMPTED", left=0).detail


def test_a_requeued_job_shows_its_requeue_reason_not_slurms_begin_time(tmp_path, monkeypatch):
    from v4launch.slurm import launcher, query
    from v4launch.training.recipe_io import load_recipe

    recipe = load_recipe(os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny_cpu.yaml")).recipe
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for event, detail in [("submit", ""), ("start", "host vm"), ("signal", "USR2: stopped after the step"),
                          ("requeue", "preemption (USR2): checkpoint saved, requeued (segment 2 of this stage) [Slurm state RUNNING]")]:
        ledger.append(run, "7", event, detail=detail)
    monkeypatch.setattr(query, "current_states", lambda ids: {"7": "PENDING"})
    monkeypatch.setattr(query, "pending_reasons", lambda ids: {"7": "BeginTime: its begin time has not come yet"})
    (row,) = launcher.job_rows(run, recipe)
    assert row.state == "requeued"
    assert row.detail.startswith("requeue: preemption (USR2): checkpoint saved, requeued (segment 2 of this stage)")
    assert "waiting to restart: BeginTime" in row.detail
