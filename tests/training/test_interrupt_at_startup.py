"""Ctrl-C / kill while a multi-process local run's workers are still starting (before their signal handlers are
in place): a cancelled run (exit 130, status 'cancelled', the command that continues or restarts it), not a
failure blamed on SIGTERM pointing at a log that does not exist; and `logs` shows the workers' own output."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from v4launch import launchers
from v4launch.errors import InterruptedRun
from v4launch.launchers import LocalLauncher


@pytest.fixture
def workers_that_never_start(monkeypatch):
    """Workers replaced by processes that print a line and sleep with no signal handler (a worker still importing
    torch); the launcher's wait interrupted as Ctrl-C does, once they run."""
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        script = "import sys, time; print('importing torch', flush=True); time.sleep(120)"
        return real_popen([sys.executable, "-c", script], **kwargs)

    def interrupted_wait(procs, rank0_out, *args, **kwargs):
        deadline = time.monotonic() + 60
        for rank, p in enumerate(procs):  # every worker is up (its output has the line) when the signal comes
            out = rank0_out.parent / f"worker{rank}.out"
            while p.poll() is None and "importing" not in out.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(launchers.subprocess, "Popen", popen)
    monkeypatch.setattr(LocalLauncher, "_wait_echoing", staticmethod(interrupted_wait))


def test_ctrl_c_while_the_workers_start_is_a_cancelled_run_not_a_failure(new_run, workers_that_never_start):
    run_dir = new_run()
    with pytest.raises(InterruptedRun) as caught:
        LocalLauncher()._spawn(run_dir, 2, None)
    err = caught.value
    assert err.exit_code == 130
    assert "stopped by a signal" in err.message and "killed by SIGTERM (signal 15)" in err.message
    assert "failed" not in err.message and "v4launch run" in err.hint and "recipe.yaml" in err.hint  # no checkpoint
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["state"] == "stopped" and launch["stopped_while_starting"] is True
    status = LocalLauncher().status(run_dir)
    assert status.state == "cancelled" and "while the workers were starting" in status.detail["cancelled_by"]
    lines = list(LocalLauncher().logs(run_dir))  # no rank log was written: the workers' output instead
    assert lines.count("importing torch") == 2


def test_a_failure_names_the_workers_output_when_no_rank_log_exists(tmp_path):
    (tmp_path / "worker1.out").write_text("")
    failure = launchers.describe_failure([0, 1], [1, 0], tmp_path)
    assert failure["log"].endswith("worker1.out")  # not a rank1.log that was never written
    (tmp_path / "rank1.log").write_text("step 3\n")
    assert launchers.describe_failure([0, 1], [1, 0], tmp_path)["log"].endswith("rank1.log")
