"""Reading a run's log files: following them as they grow, their last lines, and which rank's log explains a failure.

Used by every launcher's ``logs`` (``--rank``, ``--tail``, ``--follow``) and by the local launcher's failure report.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import UsageError


def check_rank(run_dir: Path, rank: int | None, world: int) -> None:
    """Refuse a ``--rank`` that is not a rank of the run.

    Raises:
        UsageError: ``rank`` outside 0 .. ``world`` - 1 (the message names the run's world size)."""
    if rank is not None and not 0 <= rank < world:
        raise UsageError(f"--rank {rank}: run {Path(run_dir).name} has ranks 0..{world - 1} (world size {world})",
                         hint=f"pass --rank between 0 and {world - 1}, or leave it out for every rank's log")


def follow_files(paths: list[Path], still_running: Callable[[], bool], poll_s: float = 1.0,
                 tail: int | None = None) -> Iterator[str]:
    """Yield lines of ``paths`` as they grow while ``still_running()``; then the remainder. ``tail``: of what each
    file holds at the start, only its last ``tail`` lines (None: all of it); ``poll_s``: seconds between reads. A
    file that cannot be read (not written yet) is skipped until it can."""
    offsets = {p: 0 for p in paths}
    if tail is not None:
        for p in paths:
            try:
                with p.open(errors="replace") as f:
                    lines = f.read().splitlines()
                    offsets[p] = f.tell()
            except OSError:
                continue
            yield from (lines[-tail:] if tail > 0 else [])
    while True:
        running = still_running()
        for p in paths:
            try:
                with p.open() as f:
                    f.seek(offsets[p])
                    chunk = f.read()
                    offsets[p] = f.tell()
            except OSError:
                continue
            yield from chunk.splitlines()
        if not running:
            return
        time.sleep(poll_s)


def log_tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of ``path`` ([] when it cannot be read)."""
    try:
        return path.read_text(errors="replace").rstrip().splitlines()[-lines:]
    except OSError:
        return []


def exit_words(code: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL (signal 9)`` for a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-code})"
    return f"exit code {code}"


def describe_failure(codes: list[int], exit_order: list[int], logs: Path) -> dict[str, Any]:
    """Which rank made a multi-process run fail, how, and where its output is.

    The cause is the first rank that ended with a non-zero code (the others typically fail after
    it, on the lost peer); when no rank failed (rank 0 left no result) it is rank 0.

    Returns:
        ``{"failed_rank", "failure", "log"}``: the rank, a sentence (its exit code or signal, then
        how the other ranks ended), and its output ``logs/worker<R>.out`` (stdout and stderr: the
        traceback), or its ``logs/rank<R>.log`` when that output is empty and the log exists (a rank
        killed by a signal wrote no error: its log says how far it got).
    """
    order = exit_order + [r for r in range(len(codes)) if r not in exit_order]
    rank = next((r for r in order if codes[r] != 0), 0)
    others = [f"rank {r} {exit_words(codes[r])}" for r in order if r != rank]
    what = (f"rank {rank} {exit_words(codes[rank])}" if codes[rank] != 0
            else "rank 0 exited without a result") + (f" first; then {', '.join(others)}" if others else "")
    out, rank_log = logs / f"worker{rank}.out", logs / f"rank{rank}.log"
    log = rank_log if not log_tail(out, 1) and rank_log.is_file() else out
    return {"failed_rank": rank, "failure": what, "log": str(log)}
