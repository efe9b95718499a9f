"""Live progress of a multi-process local run, drawn by the launcher from what rank 0 records.

The workers write to files (rank 0: ``metrics.jsonl`` at logged steps, ``logs/progress.rank0.json`` replaced after
every step, its console output ``logs/worker0.out``); on a terminal the launcher reads both and draws one rich progress
bar per curriculum stage: steps done of the stage's steps, tokens/s, loss and an ETA from a moving average of measured
step times. A bar's position comes from the record's ``step_in_stage`` and its total from the stage plan (the
record's ``stage_steps``), so after a resume mid-stage or a phase jump (``resume --phase``) the bars count the stage
the job is really in, to its real end. Bars move at every step (as often as the launcher polls: twice a second); the
metrics.jsonl records make sure each stage's last step is drawn even when a poll missed it. Off a terminal the
launcher echoes rank 0's plain lines instead (no bars).
"""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path
from typing import Any

PROGRESS_FILE = "progress.rank0.json"
"""Rank 0's per-step progress record, in the run's ``logs/`` (replaced atomically after every step by
``training.metrics.MetricsLogger``)."""

SUMMARY_LINE = re.compile(r"^\d\d:\d\d:\d\d step \d+/\d+ ")
"""A rank-0 console line that only repeats a logged step's numbers (the bars show them)."""

WINDOW_STEPS = 20
"""Steps the step-time moving average spans, at least (the first steps, slower while caches warm, drop out)."""


def eta_text(seconds: float | None) -> str:
    """``1m50s`` / ``2h03m`` / ``-`` (unknown) for a remaining time in seconds."""
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class StepClock:
    """Moving average of the seconds per step, from records of increasing steps (``step``, ``elapsed_s``: the job's
    cumulative training seconds), over the newest intervals that cover :data:`WINDOW_STEPS` steps."""

    def __init__(self) -> None:
        self.last: tuple[int, float] | None = None
        self.intervals: deque[tuple[int, float]] = deque()

    def add(self, step: int, elapsed_s: float | None) -> None:
        """Record a step's cumulative time; the same step again is ignored, and a step before the last one (a new
        launch replaying steps) restarts the average."""
        if elapsed_s is None or (self.last is not None and step == self.last[0]):
            return
        if self.last is not None and step > self.last[0] and elapsed_s >= self.last[1]:
            self.intervals.append((step - self.last[0], elapsed_s - self.last[1]))
            while sum(n for n, _ in self.intervals) - self.intervals[0][0] >= WINDOW_STEPS:
                self.intervals.popleft()
        elif self.last is not None and step < self.last[0]:
            self.intervals.clear()
        self.last = (step, elapsed_s)

    @property
    def seconds_per_step(self) -> float | None:
        """The average over the window (None before two records)."""
        steps = sum(n for n, _ in self.intervals)
        return sum(t for _, t in self.intervals) / steps if steps else None


def _file_id(path: Path) -> tuple[int, int] | None:
    """(inode, mtime in ns) of ``path`` (None when absent): a replaced file gets a new one."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


class LiveProgress:
    """One bar per stage, fed by rank 0's ``metrics.jsonl`` records as they are appended and by its per-step
    ``logs/progress.rank0.json`` as it is replaced."""

    def __init__(self, metrics: Path, stage_steps: dict[int, int], console: Any = None,
                 step_file: Path | None = None) -> None:
        """``metrics``: the run's metrics.jsonl (only records appended from now on are read); ``stage_steps``:
        stage index → its optimizer steps (the plan's; a record's own ``stage_steps`` wins); ``console``: a rich
        Console (default: stdout's); ``step_file``: rank 0's per-step record (default: ``logs/progress.rank0.json``
        beside ``metrics``; the one there now, from an earlier launch, is not read)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.path, self.stage_steps = Path(metrics), stage_steps
        self.step_file = Path(step_file) if step_file is not None else self.path.parent / "logs" / PROGRESS_FILE
        self.offset = self.path.stat().st_size if self.path.is_file() else 0
        self.step_file_id = _file_id(self.step_file)
        self.clock = StepClock()
        self.tasks: dict[int, Any] = {}
        self.progress = Progress(TextColumn("[bold]{task.description}[/] [cyan]{task.fields[phase]}[/]"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                                 TextColumn("eta {task.fields[eta]}"), console=console, refresh_per_second=4)
        self.progress.start()

    def print(self, text: str) -> None:
        """Show rank 0's console lines above the bars, except the per-step summaries the bars replace."""
        for line in text.splitlines():
            if not SUMMARY_LINE.match(line):
                self.progress.console.print(line, markup=False, highlight=False)

    def poll(self) -> None:
        """Read the records appended to metrics.jsonl since the last poll, then the per-step record if it was
        replaced since, and move the bars."""
        for rec in self._new_records():
            if rec.get("kind", "train") == "train" and "step_in_stage" in rec:
                self.update(rec)
        file_id = _file_id(self.step_file)
        if file_id is not None and file_id != self.step_file_id:
            try:
                rec = json.loads(self.step_file.read_text())
            except (OSError, ValueError):  # replaced again while read: the next poll reads it
                return
            self.step_file_id = file_id
            if isinstance(rec, dict) and "step_in_stage" in rec:
                self.update(rec)

    def _new_records(self) -> list[dict[str, Any]]:
        """The whole lines appended to metrics.jsonl since the last call, parsed (unparsable lines skipped)."""
        try:
            with self.path.open() as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        whole = chunk[:chunk.rfind("\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(whole.encode())
        out = []
        for line in whole.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def update(self, rec: dict[str, Any]) -> None:
        """Move the bar of ``rec``'s stage (created on its first record; earlier bars are left as they stand) to
        ``rec``'s step, never back: a record older than the bar's position (read late) only fills in what the bar
        lacks. The ETA counts the bar's steps left at the moving-average step time."""
        idx, done = int(rec["stage_index"]), int(rec["step_in_stage"])
        total = int(rec.get("stage_steps") or self.stage_steps.get(idx, done))
        if self.clock.last is None or rec["step"] > self.clock.last[0]:
            self.clock.add(rec["step"], rec.get("elapsed_s"))
        if idx not in self.tasks:
            self.tasks[idx] = self.progress.add_task(rec["stage"], total=total, phase=rec["phase"], stats="", eta="-")
        if done < next(t.completed for t in self.progress.tasks if t.id == self.tasks[idx]):
            return
        per_step = self.clock.seconds_per_step
        left = total - done
        loss = rec.get("lm_loss")
        stats = (f"lm {loss:.3f} " if loss is not None else "") + f"{rec.get('tokens_per_s') or 0:.0f} tok/s"
        self.progress.update(self.tasks[idx], completed=done, total=total, phase=rec["phase"], stats=stats,
                             eta=eta_text(per_step * left if per_step is not None else None) if left else "done")

    def bars(self) -> dict[str, tuple[float, float | None]]:
        """Stage name → (completed, total) of each bar drawn so far (what the display shows)."""
        return {t.description: (t.completed, t.total) for t in self.progress.tasks}

    def stop(self) -> None:
        """Read the last records, then stop drawing (the bars stay on the terminal)."""
        self.poll()
        self.progress.stop()
