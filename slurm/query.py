"""Thin wrappers around Slurm's client commands (squeue, sacct, scontrol, scancel).

Every call has a timeout and degrades to "unknown" instead of raising when the controller
does not answer, so ``status`` always prints something.
"""

from __future__ import annotations

import os
import subprocess
import time
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


# squeue's %r for a pending job, in words, with what to do where the user can do something
PENDING_REASONS = {
    "Priority": "queued behind jobs of higher priority",
    "Resources": "waiting for nodes / GPUs to become free",
    "Dependency": "waiting for a job it depends on",
    "BeginTime": "its begin time has not come yet",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved (`sinfo -R` says why)",
    "PartitionTimeLimit": "slurm.time_min is above the partition's time limit: lower it and resubmit",
    "PartitionNodeLimit": "more nodes than the partition allows: resubmit with fewer --nodes",
    "QOSMaxJobsPerUserLimit": "your QOS allows no more running jobs",
    "QOSMaxGRESPerUser": "your QOS's per-user GPU limit is reached",
    "AssocGrpGRES": "your account's GPU limit is reached",
    "AssocMaxJobsLimit": "your account's job limit is reached",
    "JobHeldUser": "held by you: `scontrol release JOBID`",
    "JobHeldAdmin": "held by an administrator",
}


def pending_reasons(job_ids: Iterable[str]) -> dict[str, str]:
    """Why each of the given jobs is pending (squeue ``%r``, e.g. ``Resources``), glossed with
    :data:`PENDING_REASONS`; jobs not pending or without a reason are absent."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return {}
    proc = _run(["squeue", "-h", "-j", ",".join(ids), "-t", "PENDING", "-o", "%i|%r"])
    out: dict[str, str] = {}
    if proc is not None and proc.returncode == 0:
        for line in proc.stdout.splitlines():
            job, _, reason = (part.strip() for part in line.partition("|"))
            if job in ids and reason and reason != "None":
                gloss = PENDING_REASONS.get(reason.split(",")[0].strip("()"))
                out[job] = f"{reason}: {gloss.replace('JOBID', job)}" if gloss else reason
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


def controller_info(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, Restarts, ...) as slurmctld holds them now; {} if unknown."""
    proc = _run(["scontrol", "-o", "show", "job", str(job_id)])
    if proc is None or proc.returncode != 0:
        return {}
    return dict(tok.split("=", 1) for tok in proc.stdout.split() if "=" in tok)


def controller_state(job_id: str) -> str | None:
    """The job's base state in slurmctld (e.g. COMPLETING while it is being killed); None if unknown."""
    return controller_info(job_id).get("JobState")


_WHY_ENDED = frozenset({"CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE", "FAILED", "BOOT_FAIL"})


def stop_state(job_id: str, restart_count: int, wait_s: float = 5.0) -> str | None:
    """Why Slurm is ending a signalled job, as seen from inside it: ``REQUEUED`` (Slurm requeues it:
    its restart counter already moved), ``RUNNING`` (nobody is ending it: a notice only), one of
    CANCELLED / TIMEOUT / PREEMPTED / NODE_FAIL, ``COMPLETING`` (ending, reason unknown) or None.

    slurmctld says COMPLETING for a cancel, a time limit and a requeue alike; the restart counter
    tells a requeue, and accounting (sacct, which may lag a little: polled up to ``wait_s``) the rest.
    """
    from .states import ALREADY_REQUEUED, normalise

    deadline = time.monotonic() + wait_s
    while True:
        info = controller_info(job_id)
        if not info:
            return None
        state = normalise(info.get("JobState"))
        if int(info.get("Restarts", "0") or 0) > restart_count or state in ALREADY_REQUEUED:
            return "REQUEUED"
        if state == "RUNNING" or state in _WHY_ENDED:
            return state
        acct = normalise(accounting([job_id]).get(str(job_id), {}).get("State"))
        if acct in _WHY_ENDED:
            return acct
        if time.monotonic() >= deadline:
            return state
        time.sleep(0.5)


def time_left_s(job_id: str) -> int | None:
    """Seconds before the job's time limit (None when unlimited or unknown)."""
    proc = _run(["squeue", "-h", "-j", str(job_id), "-o", "%L"])
    if proc is None or proc.returncode != 0 or not proc.stdout.strip():
        return None
    return parse_duration(proc.stdout.strip().splitlines()[0])


def _epoch(text: str | None) -> float | None:
    """``2026-11-29T15:14:13`` (scontrol's local time) as seconds since the epoch; None for Unknown/None."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp() if text else None
    except ValueError:
        return None


def end_and_preemption(job_id: str) -> tuple[float | None, bool]:
    """Slurm's record of the job: its EndTime (epoch seconds; the time limit of this attempt) and whether
    it was marked for preemption (PreemptTime set). ``(None, False)`` when the controller does not answer."""
    info = controller_info(job_id)
    return _epoch(info.get("EndTime")), _epoch(info.get("PreemptTime")) is not None


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
