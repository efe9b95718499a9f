"""The run-level requeue state machine: Slurm job states + ledger → what the user is told.

Slurm states are grouped once here. A job Slurm is requeueing (PREEMPTED, REQUEUED, a
TIMEOUT or NODE_FAIL followed by a requeue) is never shown as failed (submitit PR #1770);
application crashes (FAILED, OUT_OF_MEMORY, an exception in the ledger) are. Decisions the
job takes after a stop (requeue, leave it to Slurm, or stop the run) are pure functions so
that they are unit-tested without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from . import ledger
from .ledger import Event

LIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "COMPLETING",
                  "CONFIGURING", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD", "SPECIAL_EXIT"})
"""States of a job that still occupies (or will occupy) the queue."""
INFRA = frozenset({"PREEMPTED", "NODE_FAIL", "BOOT_FAIL"})
"""Ended by the cluster, not by the application."""
CRASH = frozenset({"FAILED", "OUT_OF_MEMORY", "DEADLINE"})
"""Ended by the application (or its resources)."""
ALREADY_REQUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
"""Seen from inside a job that was signalled: Slurm itself is requeueing it."""

TERMINAL_EVENTS = {"completed": "completed", "stage_completed": "stage completed", "failed": "failed",
                   "budget_exhausted": "failed", "exit": "stopped"}


def normalise(state: str | None) -> str:
    """``'CANCELLED by 0'`` → ``'CANCELLED'``; ``None``/empty → ``'UNKNOWN'``."""
    return (state or "UNKNOWN").split()[0].rstrip("+").upper()


def exit_signal(exit_code: str | None) -> int | None:
    """The signal that ended a job, from sacct's ``ExitCode`` (``code:signal``): ``0:9`` → 9, and a shell's
    ``137:0`` (128 + 9: srun's task was killed) → 9; None when it exited with a plain code or is unknown."""
    code, _, sig = (exit_code or "").partition(":")
    if sig.isdigit() and int(sig) > 0:
        return int(sig)
    if code.isdigit() and 128 < int(code) <= 128 + 64:
        return int(code) - 128
    return None


def job_state(slurm_state: str | None, events: Iterable[Event], exit_code: str | None = None) -> str:
    """What ``status`` shows for one job, from its Slurm state, its own ledger events and (for a FAILED
    job) sacct's ``ExitCode``.

    A FAILED job that recorded no error and was killed by SIGKILL (``kill -9``, a cleanup script; Slurm
    says no more) reads ``stopped``, as docs/slurm.md names that case: it is not requeued and
    ``v4launch resume`` continues it from the latest checkpoint.

    Returns one of: pending, running, requeued, completed, stage completed, stopped, cancelled,
    failed, timeout, preempted, node failure, unknown.
    """
    state = normalise(slurm_state)
    mine = list(events)
    last = mine[-1].event if mine else None
    if state in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED") or (state in LIVE and last == "requeue"):
        return "requeued"
    if state == "PENDING":
        return "pending"
    if last in TERMINAL_EVENTS:  # the job said how it ended (it may still be exiting): trust it
        cancelled = last == "exit" and (state == "CANCELLED" or mine[-1].detail.startswith("cancelled"))
        return "cancelled" if cancelled else TERMINAL_EVENTS[last]
    if state in LIVE:
        return "running"
    if last == "requeue":
        return "requeued"
    if state == "COMPLETED":
        return "completed"
    if state == "CANCELLED":
        return "cancelled"
    if state == "TIMEOUT":
        return "timeout"
    if state == "PREEMPTED":
        return "preempted"
    if state in ("NODE_FAIL", "BOOT_FAIL"):
        return "node failure"
    if state == "FAILED" and exit_signal(exit_code) == 9:
        return "stopped"
    if state in CRASH:
        return "failed"
    return "unknown"


def run_state(job_states: list[str]) -> str:
    """The run's state from its jobs' states (in submission order): any live job wins, else the last."""
    for live in ("running", "requeued", "pending"):
        if live in job_states:
            return live
    return job_states[-1] if job_states else "not launched"


@dataclass(frozen=True)
class Decision:
    """What a stopped job does next: ``requeue`` (v4launch requeues it), ``leave`` (Slurm already
    requeues it), or ``exit`` (the run stops here); ``event`` and ``detail`` go to the ledger."""

    action: str
    event: str
    detail: str


SIGNAL_EARLY_S = 60
"""How early Slurm may send ``--signal=SIG@T`` (sbatch(1): "Due to the resolution of event handling
by Slurm, the signal may be sent up to 60 seconds earlier than specified")."""


def after_stop(signal_name: str, slurm_state: str | None, segments: int, max_segments: int | None, *,
               cancel: bool, time_left_s: float | None, signal_delay_s: int, preempted: bool = False) -> Decision:
    """Decide what a job does after train() returned "stopped" on a signal.

    A stop on the time limit or a preemption notice, with its checkpoint saved, ends a planned segment: it is
    requeued whatever slurm.max_restarts says (that budget counts failures: :func:`on_start`), up to
    slurm.max_segments segments per curriculum stage.

    The label (time limit or preemption) comes from Slurm's own record of the job, never from how
    long the step and the save took: Slurm's state (TIMEOUT, PREEMPTED), its preemption mark
    (``PreemptTime``, ``preempted``), else whether the signal was caught inside the window in which
    Slurm sends the time-limit notice: ``EndTime - caught <= signal_delay_s + SIGNAL_EARLY_S``.

    Args:
        signal_name: ``"USR2"`` (submitit's checkpoint signal: time limit or preemption notice) or
            ``"SIGTERM"`` (preemption, ``scontrol requeue``, scancel, or a time limit on clusters
            without the user signal).
        slurm_state: why Slurm is ending the job (``query.stop_state``): REQUEUED, RUNNING,
            CANCELLED, TIMEOUT, PREEMPTED, NODE_FAIL, COMPLETING (reason unknown) or None.
        segments: segments of this stage already ended by a requeue (``ledger.segments_used``);
            ``max_segments``: slurm.max_segments (None: no cap).
        cancel: ``v4launch cancel`` asked this job to stop.
        time_left_s: seconds between the moment the signal was caught and the job's EndTime in
            Slurm's record (None if unknown).
        signal_delay_s: slurm.signal_delay_s (the ``--signal=USR2@`` the job was submitted with).
        preempted: Slurm marked the job for preemption (``scontrol show job``'s PreemptTime is set).
    """
    state = normalise(slurm_state)
    if cancel or state == "CANCELLED":
        return Decision("exit", "exit", f"cancelled ({signal_name}); checkpoint saved")
    in_window = time_left_s is not None and time_left_s <= signal_delay_s + SIGNAL_EARLY_S
    near_limit = state != "PREEMPTED" and not preempted and (state == "TIMEOUT" or in_window)
    reason = "time limit" if near_limit else "preemption"
    if state in ALREADY_REQUEUED:
        return Decision("leave", "requeue", f"{reason} ({signal_name}): requeued by Slurm; checkpoint saved")
    if state == "COMPLETING" and not preempted and not (time_left_s is not None and time_left_s <= 5):
        # Slurm is ending the job and nothing says it is a time limit or a preemption: never undo
        # what may be a plain scancel by requeueing; `v4launch resume` continues the run.
        return Decision("exit", "exit", f"ended by Slurm ({signal_name}, reason unknown); checkpoint saved, "
                                        "not requeued")
    if max_segments is not None and segments + 1 >= max_segments:
        return Decision("exit", "budget_exhausted",
                        f"{reason} ({signal_name}) at the end of segment {segments + 1} of this stage: "
                        f"slurm.max_segments={max_segments} used up; checkpoint saved (`v4launch resume` continues)")
    cap = "" if max_segments is None else f" of at most {max_segments}"
    return Decision("requeue", "requeue", f"{reason} ({signal_name}): checkpoint saved, requeued "
                                          f"(segment {segments + 2}{cap} of this stage)")


def on_start(restart_count: int, events: list[Event], job_id: str, max_restarts: int) -> list[tuple[str, str]]:
    """Ledger events a job appends when it starts, and whether the budget allows it to run.

    Args:
        restart_count: Slurm's restart counter of this job (0 on the first attempt).
        events: the run's ledger so far.

    Returns:
        ``(event, detail)`` pairs to append, in order; a ``budget_exhausted`` or ``exit`` pair means:
        do not train.
    """
    if restart_count == 0:
        return [("start", "")]
    out: list[tuple[str, str]] = []
    mine = [e for e in events if e.job_id == str(job_id)]
    ended = [e for e in mine if e.event in ("stage_completed", "completed", "exit", "failed", "budget_exhausted")]
    if ended:  # `scontrol requeue` also re-runs finished jobs: never train a run twice at once
        return [("exit", f"requeued after it had ended ({ended[-1].event}): not training again")]
    if not mine or mine[-1].event != "requeue":  # killed without our handler running (node failure, SIGKILL)
        out.append(("requeue", "requeued by Slurm without a checkpoint signal (node failure or kill)"))
    used = ledger.restarts_used(events) + len(out)  # failures only: a time-limit requeue is a planned segment
    if used > max_restarts:
        out.append(("budget_exhausted", f"{used} failures > slurm.max_restarts={max_restarts}: not training again"))
        return out
    out.append(("restart", f"restart {restart_count} (Slurm), {used} failure(s) of slurm.max_restarts={max_restarts} "
                           "used by the run"))
    return out


def requeue_outcome(decision: Decision, error: str | None) -> Decision:
    """The ledger entry after ``scontrol requeue``: done, already done by Slurm (a requeue or
    preemption in progress answers "pending execution"), or failed (the run stops here)."""
    if error is None:
        return decision
    if "pending execution" in error.lower():
        return Decision("leave", "requeue", decision.detail.replace("requeued", "requeued by Slurm", 1))
    return Decision("exit", "exit", f"{decision.detail.split(':')[0]}: scontrol requeue failed: {error}")


_TIME = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_duration(text: str) -> int | None:
    """Slurm's ``[D-][HH:]MM:SS`` (squeue ``%L``) in seconds; None for UNLIMITED / INVALID / junk."""
    m = _TIME.match(text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
