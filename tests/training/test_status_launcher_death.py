"""A local run's workers die with their launcher, and `status` reads what the run recorded (issue 42): a run whose
workers finished after the launching `v4launch` was killed with -9 is never reported 'died'."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from v4launch.launchers import LocalLauncher
from v4launch.training.worker import LAUNCHER_PID_VAR, die_with_launcher

# a launcher that spawns one "worker" (which arms the death signal like a real one), prints its pid, then waits
LAUNCHER = ("import os, subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', sys.argv[1]], env=dict(os.environ, {var}=str(os.getpid())))\n"
            "print(child.pid, flush=True)\n"
            "child.wait()\n")
WORKER = ("import signal, sys, time\n"
          "from v4launch.training.worker import die_with_launcher\n"
          "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'w').write('SIGTERM'), sys.exit(0)))\n"
          "assert die_with_launcher()\n"
          "open(sys.argv[1] + '.ready', 'w').close()\n"
          "while True: time.sleep(0.05)\n")


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(60)
def test_a_worker_gets_sigterm_when_its_launcher_is_killed(tmp_path):
    mark = tmp_path / "worker.signal"
    worker = WORKER.replace("sys.argv[1]", repr(str(mark)))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(var=LAUNCHER_PID_VAR), worker],
                                stdout=subprocess.PIPE, text=True)
    pid = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while not Path(str(mark) + ".ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(str(mark) + ".ready").exists(), "the worker never started"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _gone(pid, 20), "the worker outlived its SIGKILLed launcher"
        assert mark.read_text() == "SIGTERM"  # the job's own stop request: it saves and returns 'stopped'
    finally:
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_launcher_is_already_gone_exits():
    with pytest.raises(SystemExit):
        die_with_launcher({LAUNCHER_PID_VAR: str(os.getppid() + 1)})
    assert die_with_launcher({LAUNCHER_PID_VAR: str(os.getppid())})
    assert die_with_launcher({})


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run_dir(root: Path, result: dict | None, world: int = 2) -> Path:
    """A local run directory whose launch.json says 'running' (its launcher was killed) with dead pids."""
    run = root / "tiny-20260101-000000"
    (run / "logs").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 150, "stage": "sparse_2k",
                                                   "phase": "sparse", "lm_loss": 2.5}) + "\n")
    (run / "run.json").write_text(json.dumps({"name": run.name, "launcher": "local"}))
    (run / "launch.json").write_text(json.dumps({"launcher": "local", "state": "running", "world_size": world,
                                                 "pids": [_dead_pid(), _dead_pid()]}))
    if result is not None:
        (run / "logs" / "result.rank0.json").write_text(json.dumps(result))
    return run


def test_a_run_its_workers_completed_reads_completed_not_died(tmp_path):
    run = _run_dir(tmp_path, {"status": "completed", "stage_index": 2, "step": 150, "checkpoint": None})
    st = LocalLauncher().status(run)
    assert st.state == "completed" and "failure" not in st.detail
    assert "rank 0 recorded 'completed' at step 150" in st.detail["launcher_gone"]


def test_workers_stopped_by_the_launchers_death_read_cancelled_by_it(tmp_path):
    run = _run_dir(tmp_path, {"status": "stopped", "stage_index": 0, "step": 40, "checkpoint": None})
    st = LocalLauncher().status(run)
    assert st.state == "cancelled" and "death of the launching" in st.detail["cancelled_by"]


def test_a_run_that_recorded_nothing_still_reads_died(tmp_path):
    st = LocalLauncher().status(_run_dir(tmp_path, None))
    assert st.state == "died" and "gone without recording" in st.detail["failure"]


def test_status_cli_titles_a_local_runs_process_ids_pid(tmp_path):
    run = _run_dir(tmp_path, {"status": "completed", "stage_index": 2, "step": 150, "checkpoint": None})
    exe = str(Path(sys.executable).with_name("v4launch"))
    out = subprocess.run([exe, "status", str(run)], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, COLUMNS="200"), timeout=120)
    assert out.returncode == 0, out.stderr
    header = next(line for line in out.stdout.splitlines() if "state" in line and "stage" in line)
    assert "pid" in header.split() and "job" not in header.split()
    assert "rank 0 recorded 'completed'" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(400)
def test_kill_9_of_a_real_launcher_stops_its_workers_and_status_says_so(workspace, write_recipe):
    recipe = write_recipe(over={"cluster": {"gpus_per_node": 2}, "logging": {"interval_steps": 1},
                                "curriculum": {"stages": [{"name": "dense", "seq_len": 64, "phase": "dense",
                                                           "steps": 5000}]}})
    exe = str(Path(sys.executable).with_name("v4launch"))
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([exe, "run", str(recipe), "--no-progress"], cwd=workspace, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if " step 2/" in line or time.monotonic() > deadline:
            break
    (run,) = (workspace / "runs").iterdir()
    pids = json.loads((run / "launch.json").read_text())["pids"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert all(_gone(p, 120) for p in pids), "workers outlived their SIGKILLed launcher"
    st = subprocess.run([exe, "status", str(run), "--json"], cwd=workspace, capture_output=True, text=True,
                        env=env, timeout=120)
    detail = json.loads(st.stdout)
    assert st.returncode == 0 and detail["state"] == "cancelled", detail
    assert "death of the launching" in detail["cancelled_by"] and detail["checkpoint"], detail
    assert "rank 0 recorded 'stopped'" in detail["launcher_gone"]
