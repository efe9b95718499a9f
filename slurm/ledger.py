"""``<run_dir>/ledger.jsonl``: the append-only history of a run's Slurm jobs.

One JSON object per line: ``time`` (UTC ISO), ``job_id``, ``event``, ``stage`` (curriculum
stage index), ``step`` (global optimizer step), ``detail`` (free text). Written by ``submit``,
``cancel`` and by rank 0 of every job; read by ``status`` and by the job itself (restart budget,
cancel requests). Appends are serialised with ``flock`` so a CLI and a job never interleave.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

LEDGER = "ledger.jsonl"

EVENTS = (
    "submit",            # a job was submitted (first stage, next stage, or a relaunch)
    "start",             # a job started (first attempt)
    "restart",           # a requeued job started again
    "signal",            # the job received its checkpoint signal (USR2) or SIGTERM
    "requeue",           # the job was requeued (by v4launch after a checkpoint, or by Slurm)
    "stage_completed",   # a curriculum stage finished; the next stage is submitted
    "completed",         # the whole curriculum finished
    "exit",              # the job ended without finishing (max_steps, cancelled, not requeued)
    "failed",            # the job raised; detail holds the error
    "budget_exhausted",  # slurm.max_restarts failures or a stage's slurm.max_segments were used up: the run is stopped
    "cancel",            # `v4launch cancel` asked this job to stop
)


@dataclass(frozen=True)
class Event:
    """One ledger line."""

    time: str
    job_id: str | None
    event: str
    stage: int | None = None
    step: int | None = None
    detail: str = ""


def ledger_path(run_dir: Path) -> Path:
    """``<run_dir>/ledger.jsonl``."""
    return Path(run_dir) / LEDGER


def append(run_dir: Path, job_id: str | None, event: str, *, stage: int | None = None, step: int | None = None,
           detail: str = "") -> Event:
    """Append one event (atomically with respect to other writers) and return it.

    Raises:
        ValueError: ``event`` is not one of :data:`EVENTS` (a programming error).
    """
    if event not in EVENTS:
        raise ValueError(f"unknown ledger event {event!r}; known: {', '.join(EVENTS)}")
    rec = Event(time=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                job_id=None if job_id is None else str(job_id), event=event, stage=stage, step=step, detail=detail)
    line = json.dumps(asdict(rec), sort_keys=True) + "\n"
    fd = os.open(ledger_path(run_dir), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line.encode())
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return rec


def read(run_dir: Path) -> list[Event]:
    """Every event of the run in order ([] when there is no ledger); unreadable lines are skipped."""
    try:
        lines = ledger_path(run_dir).read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            data = json.loads(line)
            events.append(Event(**{k: data.get(k) for k in Event.__dataclass_fields__}))
        except (ValueError, TypeError):
            continue
    return events


def job_ids(events: Iterable[Event]) -> list[str]:
    """The run's job ids in submission order (each once)."""
    seen: list[str] = []
    for e in events:
        if e.job_id and e.job_id not in seen:
            seen.append(e.job_id)
    return seen


SEGMENT_REASONS = ("time limit", "preemption")
"""How the detail of a requeue after a caught checkpoint signal begins (``states.after_stop``): the job saved its
checkpoint and is requeued to go on, a planned segment. Any other requeue (``states.on_start``: Slurm restarted a
job that never caught its signal, after a node failure or a kill) is a failure."""


def is_segment_end(event: Event) -> bool:
    """Whether ``event`` is a requeue that ends a planned segment (time limit or preemption, checkpoint saved)."""
    return event.event == "requeue" and (event.detail or "").startswith(SEGMENT_REASONS)


def restarts_used(events: Iterable[Event]) -> int:
    """Failures so far: requeues that did not follow a caught checkpoint signal (node failures, kills), counted
    against slurm.max_restarts. A time-limit or preemption requeue is a planned segment (:func:`segments_used`)."""
    return sum(1 for e in events if e.event == "requeue" and not is_segment_end(e))


def segments_used(events: Iterable[Event], stage: int | None = None) -> int:
    """Planned segments ended so far (time-limit and preemption requeues with a checkpoint), of curriculum stage
    ``stage`` (None: the whole run); counted against slurm.max_segments, per stage."""
    return sum(1 for e in events if is_segment_end(e) and (stage is None or e.stage == stage))


def cancel_requested(events: Iterable[Event], job_id: str) -> bool:
    """Whether ``v4launch cancel`` asked job ``job_id`` to stop."""
    return any(e.event == "cancel" and e.job_id == str(job_id) for e in events)


def for_job(events: Iterable[Event], job_id: str) -> list[Event]:
    """The events of one job, in order."""
    return [e for e in events if e.job_id == str(job_id)]
