"""Live progress of a multi-process local run, drawn by the launcher from what rank 0 records.

The workers write to files (rank 0: ``metrics.jsonl``, its console output ``logs/worker0.out``); on a terminal the
launcher tails ``metrics.jsonl`` and draws one rich progress bar per curriculum stage: steps done of the stage's
steps, tokens/s, loss and an ETA from a moving average of measured step times. A bar's position comes from the
record's ``step_in_stage`` and its total from the stage plan, so after a resume mid-stage or a phase jump (``resume
--phase``) the bars count the stage the job is really in, to its real end. Bars move at every logged step
(``logging.interval_steps``, and each stage's first and last step). Off a terminal the launcher echoes rank 0's
plain lines instead (no bars).
"""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path
from typing import Any

SUMMARY_LINE = re.compile(r"^\d\d:\d\d:\d\d step \d+/\d+ ")
"""A rank-0 console line that only repeats a logged step's numbers (the bars show them)."""

WINDOW = 5
"""Logged intervals the step-time moving average spans (the first steps, slower while caches warm, drop out)."""


def eta_text(seconds: float | None) -> str:
    """``1m50s`` / ``2h03m`` / ``-`` (unknown) for a remaining time in seconds."""
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class StepClock:
    """Moving average of the seconds per step, from consecutive train records (``step``, ``elapsed_s``: the job's
    cumulative training seconds), over the last :data:`WINDOW` intervals."""

    def __init__(self) -> None:
        self.last: tuple[int, float] | None = None
        self.intervals: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def add(self, step: int, elapsed_s: float | None) -> None:
        """Record a logged step; a step at or before the last one (a new launch replaying steps) restarts."""
        if elapsed_s is None:
            return
        if self.last is not None and step > self.last[0] and elapsed_s >= self.last[1]:
            self.intervals.append((step - self.last[0], elapsed_s - self.last[1]))
        elif self.last is not None and step <= self.last[0]:
            self.intervals.clear()
        self.last = (step, elapsed_s)

    @property
    def seconds_per_step(self) -> float | None:
        """The average over the window (None before two records)."""
        steps = sum(n for n, _ in self.intervals)
        return sum(t for _, t in self.intervals) / steps if steps else None


class LiveProgress:
    """One bar per stage, fed by rank 0's ``metrics.jsonl`` records as they are appended."""

    def __init__(self, metrics: Path, stage_steps: dict[int, int], console: Any = None) -> None:
        """``metrics``: the run's metrics.jsonl (only records appended from now on are read); ``stage_steps``:
        stage index → its optimizer steps (the plan's); ``console``: a rich Console (default: stdout's)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.path, self.stage_steps = Path(metrics), stage_steps
        self.offset = self.path.stat().st_size if self.path.is_file() else 0
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
        """Read the records appended since the last poll and move the bars."""
        try:
            with self.path.open() as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        whole = chunk[:chunk.rfind("\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(whole.encode())
        for line in whole.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind", "train") == "train" and "step_in_stage" in rec:
                self.update(rec)

    def update(self, rec: dict[str, Any]) -> None:
        """Move the bar of ``rec``'s stage (created on its first record; earlier bars are left as they stand)."""
        idx = int(rec["stage_index"])
        total = self.stage_steps.get(idx, rec["step_in_stage"])
        self.clock.add(rec["step"], rec.get("elapsed_s"))
        if idx not in self.tasks:
            self.tasks[idx] = self.progress.add_task(rec["stage"], total=total, phase=rec["phase"], stats="", eta="-")
        per_step = self.clock.seconds_per_step
        left = total - rec["step_in_stage"]
        stats = f"lm {rec['lm_loss']:.3f} {rec.get('tokens_per_s', 0):.0f} tok/s"
        self.progress.update(self.tasks[idx], completed=rec["step_in_stage"], phase=rec["phase"], stats=stats,
                             eta=eta_text(per_step * left if per_step is not None else None) if left else "done")

    def bars(self) -> dict[str, tuple[float, float | None]]:
        """Stage name → (completed, total) of each bar drawn so far (what the display shows)."""
        return {t.description: (t.completed, t.total) for t in self.progress.tasks}

    def stop(self) -> None:
        """Read the last records, then stop drawing (the bars stay on the terminal)."""
        self.poll()
        self.progress.stop()
