"""Helpers of the Slurm tests: dev-cluster detection, the CLI, the ledger, bounded waits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
V4LAUNCH = str(Path(sys.executable).with_name("v4launch"))
STANDIN = f"{Path(__file__).with_name('standin_train.py')}:train"

# Small enough to run a few real steps a minute on 2 shared CPU cores.
QUICK = ["curriculum.stages.0.seq_len=256", "curriculum.stages.1.seq_len=256", "curriculum.stages.2.seq_len=256",
         "parallel.global_batch_size=2", "data.max_documents=50", "checkpointing.interval_steps=2",
         "run.threads=1", "logging.tensorboard=false", "logging.plot=false", "logging.interval_steps=1", "slurm.cpus_per_task=1", "slurm.time_min=20"]


def _ok(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None


def cluster_problem() -> str | None:
    """Why the dev cluster cannot take jobs, or None when it can."""
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        return "Slurm is not installed here: start the dev cluster with `scripts/dev-cluster up`"
    ping = _ok(["scontrol", "ping"])
    if ping is None or "is UP" not in ping.stdout:
        return "slurmctld is not answering: start the dev cluster with `scripts/dev-cluster up`"
    node = _ok(["sinfo", "-h", "-o", "%T"])
    state = node.stdout.split()[0] if node is not None and node.stdout.split() else "unknown"
    if state.rstrip("*~#") not in ("idle", "mixed", "allocated", "completing"):
        return f"the dev cluster's node is {state}: see `scripts/dev-cluster status`"
    acct = _ok(["sacct", "-n", "-X", "-S", "now-1minutes"])
    if acct is None or acct.returncode != 0:
        return "Slurm accounting (sacct) is not available: `scripts/dev-cluster up` starts slurmdbd"
    return None


def cli(*args: str, cwd: Path, timeout: float = 120, columns: int = 160) -> subprocess.CompletedProcess:
    """Run the v4launch command (a separate process, exactly as a user would) on a terminal ``columns`` wide."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS=str(columns))
    return subprocess.run([V4LAUNCH, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ledger events."""
    path = run_dir / "ledger.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl train records in file order."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def diagnostics(run_dir: Path | None) -> str:
    """What to print when a wait times out: ledger, queue, log tails."""
    out = [subprocess.run(["squeue"], capture_output=True, text=True).stdout]
    if run_dir is not None:
        out.append("ledger:\n" + "\n".join(json.dumps(e) for e in ledger(run_dir)))
        for log in sorted((run_dir / "slurm").glob("*_0_log.*")):
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    return "\n".join(out)


def wait_for(what: str, predicate: Callable[[], Any], timeout: float, run_dir: Path | None = None) -> Any:
    """Poll ``predicate`` every second until it returns something truthy; fail after ``timeout`` s,
    or at once when every job of ``run_dir`` has left the queue without it becoming true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if run_dir is not None and ledger(run_dir) and queue_empty(run_dir):
            value = predicate()
            if value:
                return value
            pytest.fail(f"the run ended before {what}\n{diagnostics(run_dir)}")
        time.sleep(1.0)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{diagnostics(run_dir)}")


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """Ledger events called ``name``."""
    return [e for e in ledger(run_dir) if e["event"] == name]


def queue_empty(run_dir: Path) -> bool:
    """No job of the run is still queued or running."""
    ids = {e["job_id"] for e in ledger(run_dir) if e["job_id"]}
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    return not ids.intersection(out)


def finished(run_dir: Path) -> bool:
    """None of the run's jobs is queued or running any more (however the run ended)."""
    return bool(ledger(run_dir)) and queue_empty(run_dir)


def signal_job(job_id: str, how: str) -> None:
    """Deliver a preemption: ``usr2`` (submitit's checkpoint signal) or ``requeue`` (scontrol requeue)."""
    cmd = (["scancel", "--signal=USR2", job_id] if how == "usr2" else ["scontrol", "requeue", job_id])
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def job_log_err(run_dir: Path, job_id: str) -> str:
    """Rank 0's stderr of a job."""
    path = run_dir / "slurm" / f"{job_id}_0_log.err"
    return path.read_text(errors="replace") if path.exists() else ""


def submit_standin(overrides: list[str], recipe: Path = REPO / "recipes" / "tiny_cpu.yaml") -> tuple[Path, str]:
    """Create a Slurm run of ``recipe`` + overrides and submit it with the stand-in train (library API)."""
    from v4launch.slurm.submit import code_revision, prepare_run, submit_run
    from v4launch.training.recipe_io import load_recipe

    loaded = load_recipe(recipe, overrides)
    run_dir = prepare_run(loaded, code_revision())
    return run_dir, submit_run(run_dir, entry=STANDIN, stage=0)
