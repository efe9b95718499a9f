"""Profile a range of training steps of a real run: ``V4LAUNCH_PROFILE_STEPS=first:last v4launch run …``.

torch.profiler records steps ``first`` to ``last`` (global optimizer steps, 1-based, both included) on every
rank, with CPU and CUDA activity. When the last one ends, each rank writes
``<run>/profile/rank<R>_steps<first>-<last>.txt``: wall, host (self CPU) and device (self CUDA) time per step,
the operators and kernels that took the most time (``key_averages``), then those launched most often per step
(a storm of tiny kernels costs launch time and a few microseconds of GPU each, and ranks low by time alone),
and beside it ``rank<R>_steps<first>-<last>.trace.json.gz``, the Chrome trace (Perfetto or
``chrome://tracing`` open it gzipped). An environment variable, not a
recipe field: it changes nothing the run computes, reaches the worker processes and Slurm jobs unchanged,
and is not frozen into the run's recipe.
"""

from __future__ import annotations

import collections
import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from ..errors import UsageError

ENV = "V4LAUNCH_PROFILE_STEPS"
ROWS = 40
"""Operators listed in the table by time."""
LAUNCH_ROWS = 15
"""Operators listed in the table by calls per step."""
NAME_WIDTH = 100
"""Characters of an operator's or kernel's name shown (kernel names differ late: ``..._kernel<4, at::...``)."""


def parse_steps(text: str) -> tuple[int, int]:
    """``"5:8"`` -> (5, 8); ``"7"`` -> (7, 7).

    Raises:
        UsageError: not ``first:last`` with 1 <= first <= last (names the variable, the value and the fix).
    """
    first, _, last = text.strip().partition(":")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        a, b = 0, -1
    if not 1 <= a <= b:
        raise UsageError(f"{ENV}={text!r}: expected first:last, two global step numbers with 1 <= first <= last",
                         hint=f"e.g. {ENV}=5:8 profiles steps 5 to 8; unset it to train without the profiler")
    return a, b


HOST_WAIT_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
                             "Command Buffer Full"})
"""CUDA runtime calls and events in which the host only waits for the GPU: their self time is idle, not host
work. ``Command Buffer Full`` is the profiler's record of a launch waiting for room in the GPU's full launch
queue; it also carries device time, which is no kernel's (the H200 product profile of 2026-12-03 counted 16 ms
of it per step as device time: 149.2 ms where the kernels took 133.4)."""


def host_and_device_ms(events: Any) -> tuple[float, float]:
    """(host, device) milliseconds of a ``key_averages()`` list, each counted once.

    Host: the self CPU time of the CPU events (self times partition the host's call tree), less the time spent
    waiting for the GPU in :data:`HOST_WAIT_CALLS` (a profiled step ends in a synchronisation, whose wait would
    otherwise read as host work: a CUDA-graph replay's 0.5 ms of host work read as 142 ms). Device: the self
    time of the device's own events (kernels, copies, sets; not the waits' device records), not the CPU
    operators that launched them (they
    repeat their kernels' time) nor the ranges marked on the device timeline by ``record_function`` and the
    optimizer (``Optimizer.step#…``, autograd functions: they span their kernels).
    """
    from torch.autograd import DeviceType

    host = sum(e.self_cpu_time_total for e in events
               if e.device_type == DeviceType.CPU and e.key not in HOST_WAIT_CALLS)
    device = sum(getattr(e, "self_device_time_total", 0.0) for e in events
                 if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                 and e.key not in HOST_WAIT_CALLS)
    return host / 1e3, device / 1e3


def host_waits(step: Callable[[], Any], where: Callable[[list[traceback.FrameSummary]], str]) -> collections.Counter:
    """Run ``step`` once under ``torch.cuda.set_sync_debug_mode("warn")`` and count the host's waits on the GPU
    (stream synchronisations: ``.item()``, ``.tolist()``, blocking copies), keyed by ``where(frames)``: the Python
    stack at the waiting call, innermost last, without the warnings machinery's own frames. A wait inside the autograd engine surfaces at the frame that
    called ``backward``. CUDA only; ``step`` runs exactly once. Source: torch's sync debug mode, whose warnings
    carry no stack themselves."""
    import torch

    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            seen[where([f for f in traceback.extract_stack()[:-1] if f.filename != warnings.__file__])] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return seen


class StepProfiler:
    """Starts torch.profiler before step ``first`` and writes its tables after step ``last`` (or does nothing).

    Args:
        out_dir: where the table goes (``<run>/profile``); rank: this process's global rank.
        spec: the ``first:last`` text (default: the environment variable; None or empty: off).
    Raises:
        UsageError: a malformed spec (:func:`parse_steps`).
    """

    def __init__(self, out_dir: Path, rank: int, spec: str | None = None) -> None:
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.steps = parse_steps(spec) if spec.strip() else None
        self.out_dir, self.rank = out_dir, rank
        self._prof: Any = None
        self._t0 = 0.0
        self._closed = False

    def begin(self, step: int) -> None:
        """Call before global step ``step`` (1-based) runs."""
        if self.steps is None or step != self.steps[0]:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def end(self, step: int) -> Path | None:
        """Call after global step ``step`` ran; after the last profiled step, returns the table written."""
        if self._prof is None or self.steps is None or step != self.steps[1]:
            return None
        return self._stop(step)

    def close(self, step: int) -> str | None:
        """Call when the job stops at global step ``step`` (end of the curriculum, ``--max-steps``, a signal, an
        error): a window still open is closed and written for the steps it saw; returns what to log, or None
        when there is nothing to say (profiling off, or the window was written at its last step)."""
        if self.steps is None or self._closed:
            return None
        self._closed = True
        first, last = self.steps
        if self._prof is not None:
            return f"torch.profiler of steps {first}-{step} (the run stopped before step {last}): {self._stop(step)}"
        if step < first:
            return f"{ENV}={first}:{last}: the run stopped at step {step}, before step {first}: nothing profiled"
        return None

    def _stop(self, step: int) -> Path:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        prof, self._prof = self._prof, None
        return self._write(prof, wall, step)

    def _write(self, prof: Any, wall: float, last: int) -> Path:
        first = self.steps[0]
        n = last - first + 1
        events = prof.key_averages()
        cpu, cuda = host_and_device_ms(events)
        cpu, cuda = cpu / n, cuda / n
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{self.rank}_steps{first}-{last}.txt"
        import torch

        device = f"{cuda:.1f} ms/step" if torch.cuda.is_available() else "n/a (no GPU)"
        header = (f"steps {first}-{last} ({n}), rank {self.rank}: wall {1e3 * wall / n:.1f} ms/step, "
                  f"host (self CPU, GPU waits excluded) {cpu:.1f} ms/step, device (self CUDA) {device}\n\n")
        path.write_text(header + events.table(sort_by=sort, row_limit=ROWS, max_name_column_width=NAME_WIDTH)
                        + "\n\n" + most_launched(events, n, "self_device_time_total" if cuda else "self_cpu_time_total"))
        prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}_steps{first}-{last}.trace.json.gz"))  # gzipped by torch
        return path


def most_launched(events: Any, steps: int, time_key: str) -> str:
    """The :data:`LAUNCH_ROWS` operators and kernels with the most calls per step, as text lines: calls per step,
    ``time_key`` (microseconds in ``events``) as milliseconds per step, the name.

    Args:
        events: ``profile.key_averages()``.
        steps: optimizer steps the profile covered (> 0).
        time_key: ``self_device_time_total`` (a GPU run) or ``self_cpu_time_total``.
    """
    rows = sorted(events, key=lambda e: e.count, reverse=True)[:LAUNCH_ROWS]
    unit = "device" if "device" in time_key else "host"
    lines = [f"most calls per step (calls per step, averaged; self {unit} ms per step; the name):"]
    lines += [f"{e.count / steps:10.1f}  {getattr(e, time_key, 0) / 1e3 / steps:9.3f} ms  {e.key[:NAME_WIDTH]}"
              for e in rows]
    return "\n".join(lines) + "\n"
