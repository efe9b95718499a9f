"""A Slurm job killed with -9 (no error recorded, sacct FAILED with signal 9) reads 'stopped', as docs/slurm.md names
that case, with a reason line; any other unrecorded FAILED end still reads 'failed', with its exit code said
(issue 42). No cluster needed: Slurm's answers are stood in for."""

from __future__ import annotations

import os

import pytest

from v4launch.slurm import ledger
from v4launch.slurm.ledger import Event
from v4launch.slurm.states import exit_signal, job_state

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny_cpu.yaml")


def ev(event, detail=""):
    return Event(time="t", job_id="7", event=event, detail=detail)


@pytest.mark.parametrize("code, sig", [("0:9", 9), ("137:0", 9), ("0:11", 11), ("1:0", None), ("0:0", None),
                                       (None, None), ("", None)])
def test_exit_signal(code, sig):
    assert exit_signal(code) == sig


@pytest.mark.parametrize("code, events, shown", [
    ("0:9", [ev("start")], "stopped"),         # kill -9: a reason Slurm does not tell
    ("137:0", [ev("start")], "stopped"),       # srun's task killed by SIGKILL
    ("0:11", [ev("start")], "failed"),         # a segfault is a crash
    ("1:0", [ev("start")], "failed"),
    ("0:9", [ev("start"), ev("failed", "RuntimeError: x")], "failed"),  # the job recorded its error
])
def test_a_sigkilled_failed_job_reads_stopped(code, events, shown):
    assert job_state("FAILED", events, code) == shown


def _rows(tmp_path, monkeypatch, exit_code):
    from v4launch.slurm import launcher, query
    from v4launch.training.recipe_io import load_recipe

    recipe = load_recipe(TINY).recipe
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ledger.append(run, "7", "submit")
    ledger.append(run, "7", "start", detail="host vm")
    monkeypatch.setattr(query, "current_states", lambda ids: {"7": "FAILED"})
    monkeypatch.setattr(query, "pending_reasons", lambda ids: {})
    monkeypatch.setattr(query, "accounting", lambda ids: {j: {"State": "FAILED", "ExitCode": exit_code} for j in ids})
    return run, launcher.job_rows(run, recipe)


def test_status_row_says_why_a_killed_job_stopped(tmp_path, monkeypatch):
    run, (row,) = _rows(tmp_path, monkeypatch, "0:9")
    assert row.state == "stopped"
    assert "killed by SIGKILL (ExitCode 0:9) for a reason Slurm does not tell" in row.detail
    assert f"v4launch resume {run}" in row.detail


def test_an_unrecorded_crash_still_fails_with_a_reason_line(tmp_path, monkeypatch):
    from v4launch.slurm.launcher import SlurmLauncher

    run, (row,) = _rows(tmp_path, monkeypatch, "0:11")
    assert row.state == "failed" and "killed by signal 11" in row.detail
    (run / "run.json").write_text('{"launcher": "slurm"}')
    (run / "recipe.yaml").write_text(open(TINY).read())
    st = SlurmLauncher().status(run)
    assert st.state == "failed" and "killed by signal 11" in st.detail["failure"]
