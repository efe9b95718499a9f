"""Thin wrappers around Slurm's client commands (squeue, sacct, scontrol, scancel).

Every call has a timeout and degrades to "unknown" instead of raising when the controller
does not answer, so ``status`` always prints something.
"""

from __future__ import annotations

import os
import subprocess
from typing import Iterable

from .states import parse_duration

TIMEOUT_S = 30
RESTART_COUNT_VAR = "SLURM_RESTART_COUNT"
JOB_ID_VAR = "SLURM_JOB_ID"


def _run(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None


def queue_states(job_ids: Iterable[str]) -> dict[str, str]:
    """States of the given jobs still in the queue (squeue); absent ids have left it."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return {}
    proc = _run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T"])
    out: dict[str, str] = {}
    if proc is not None and proc.returncode == 0:
        for line in proc.stdout.splitlines():
            job, _, state = line.partition("|")
            if job.strip() in ids:
                out[job.strip()] = state.strip()
    return out


def accounting(job_ids: Iterable[str]) -> dict[str, dict[str, str]]:
    """sacct's record of the latest attempt of each job: State, ExitCode, Elapsed, Start, End."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return {}
    fields = "JobID,State,ExitCode,Elapsed,Start,End"
    proc = _run(["sacct", "-n", "-X", "-P", "-o", fields, "-j", ",".join(ids)])
    out: dict[str, dict[str, str]] = {}
    if proc is not None and proc.returncode == 0:
        names = fields.split(",")
        for line in proc.stdout.splitlines():
            rec = dict(zip(names, line.split("|")))
            if rec.get("JobID") in ids:
                out[rec["JobID"]] = rec
    return out


def current_states(job_ids: Iterable[str]) -> dict[str, str]:
    """Best current state of each job: squeue while queued, else sacct, else UNKNOWN."""
    ids = [str(j) for j in job_ids]
    queued = queue_states(ids)
    done = accounting([j for j in ids if j not in queued])
    return {j: queued.get(j) or done.get(j, {}).get("State") or "UNKNOWN" for j in ids}


def controller_state(job_id: str) -> str | None:
    """The job's base state as slurmctld holds it now (``scontrol show job``), e.g. CANCELLED while
    the job is still completing, PENDING right after a requeue; None if unknown."""
    proc = _run(["scontrol", "-o", "show", "job", str(job_id)])
    if proc is None or proc.returncode != 0:
        return None
    for token in proc.stdout.split():
        if token.startswith("JobState="):
            return token.split("=", 1)[1]
    return None


def time_left_s(job_id: str) -> int | None:
    """Seconds before the job's time limit (None when unlimited or unknown)."""
    proc = _run(["squeue", "-h", "-j", str(job_id), "-o", "%L"])
    if proc is None or proc.returncode != 0 or not proc.stdout.strip():
        return None
    return parse_duration(proc.stdout.strip().splitlines()[0])


def requeue(job_id: str) -> str | None:
    """``scontrol requeue JOB``; returns None on success, else Slurm's error text."""
    proc = _run(["scontrol", "requeue", str(job_id)])
    if proc is None:
        return "scontrol did not answer"
    return None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()


def cancel(job_ids: Iterable[str]) -> str | None:
    """``scancel`` the jobs; returns None on success, else Slurm's error text."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return None
    proc = _run(["scancel", *ids])
    if proc is None:
        return "scancel did not answer"
    return None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()


def restart_count(environ: dict[str, str] | None = None) -> int:
    """How many times Slurm restarted the current job (0 on its first attempt)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get(RESTART_COUNT_VAR, "0") or 0)
    except ValueError:
        return 0


def clean_submit_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment to run sbatch with from inside a job: without the job's own SLURM_* /
    SUBMITIT_* variables (they would leak into the next job) and without the rendezvous keys."""
    from .rendezvous import RENDEZVOUS_KEYS

    keep = {"SLURM_CONF"}
    return {k: v for k, v in environ.items()
            if k in keep or not (k.startswith(("SLURM_", "SUBMITIT_", "SRUN_")) or k in RENDEZVOUS_KEYS)}
