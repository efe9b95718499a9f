"""Where a step's numbers go: metrics.jsonl, TensorBoard, the console and the rank log.

metrics.jsonl (rank 0) holds one JSON object per line:

* ``{"kind": "train", "stage", "stage_index", "phase", "step", "tokens", "lr", "muon_lr",
  "lm_loss", "aux": {name: raw}, "aux_sum": {kind: raw sum}, "aux_weighted": {kind: coeff · sum},
  "loss_weights": {kind: coeff}, "total_loss", "grad_norm", "tokens_per_s", "elapsed_s", "host_rss_gib",
  "gpu_peak_gib" (on a GPU)}``
* ``{"kind": "eval", "at", "stage", "stage_index", "phase", "seq_len", "step", "step_in_stage", "lm_loss"}`` at
  every stage end (``at``: ``stage_end``) and every ``logging.eval_interval_steps`` steps of a stage (``interval``);
  the held-out micro-batches are the stage's rows (``seq_len`` tokens each), so two evaluations read the same
  documents exactly when their seq_len is the same
* ``{"kind": "event", "step", "event", ...}`` for phase changes, checkpoints, stops.

Rank 0 also replaces ``logs/progress.rank0.json`` after every step (:func:`progress_record`: where the step is in its
stage, the stage's planned steps, tokens/s, lm loss, cumulative training seconds), so the launcher's live bars move at
every step, not only at the logged ones (``v4launch.live_progress``).

TensorBoard gets the same numbers as scalars (``loss/lm``, ``aux/<name>``, ``aux_sum/<kind>``, …), and so
does every tracker (``trackers.py``: Weights & Biases), under the same names at the same steps.
The console shows one rich progress bar per stage on a TTY (``v4launch.live_progress``), else (or with
``progress=False``) one plain line per logged step; every rank appends plain lines to ``logs/rank<R>.log``.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from ..live_progress import PROGRESS_FILE, LiveProgress
from ..rundir import write_json_atomic



def _fmt(v: float | None, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def _eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def summary_line(rec: dict[str, Any], total_steps: int, eta_s: float | None) -> str:
    """One human line of a train record (stage, phase, step/total, losses, tokens/s, ETA)."""
    s = rec.get("aux_sum", {})
    return (f"step {rec['step']}/{total_steps} {rec['stage']} ({rec['phase']}) lm {_fmt(rec['lm_loss'])} "
            f"kl {_fmt(s.get('indexer_kl'))} bal {_fmt(s.get('balance'))} mtp {_fmt(s.get('mtp'))} "
            f"lr {rec['lr']:.2e} gn {rec['grad_norm']:.3f} tok/s {rec['tokens_per_s']:.0f}"
            + (f" eta {_eta(eta_s)}" if eta_s is not None else ""))


_PROCESS: Any = None


def memory_gib(device: Any) -> dict[str, float]:
    """This process's memory now, for its train records (GiB = 2^30 bytes): ``host_rss_gib``, the resident
    host memory (psutil); on a CUDA ``device`` also ``gpu_peak_gib``, the peak allocated since the job started
    (``torch.cuda.max_memory_allocated``: a host-side counter, no synchronisation)."""
    global _PROCESS
    import psutil

    _PROCESS = _PROCESS or psutil.Process()
    out = {"host_rss_gib": _PROCESS.memory_info().rss / 2**30}
    if getattr(device, "type", None) == "cuda":
        import torch

        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def progress_record(rec: dict[str, Any], stage_steps: int) -> dict[str, Any]:
    """The per-step progress record of a train record ``rec`` whose stage plans ``stage_steps`` optimizer steps:
    ``step``, ``step_in_stage``, ``stage``, ``stage_index``, ``phase``, ``stage_steps``, ``lm_loss`` (nats/token),
    ``tokens_per_s``, ``step_time_s`` and ``elapsed_s`` (the job's cumulative training seconds), ``time`` (Unix
    seconds when written). Every value is one the step's record already holds on the host: writing it adds no
    device synchronisation."""
    keys = ("step", "step_in_stage", "stage", "stage_index", "phase", "lm_loss", "tokens_per_s", "step_time_s",
            "elapsed_s")
    return {**{k: rec.get(k) for k in keys}, "stage_steps": stage_steps, "time": time.time()}


def train_scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars of a train record, by TensorBoard tag (``loss/lm``, ``aux/<name>``, ``lr/adamw``, …)."""
    out = {"loss/lm": rec["lm_loss"], "loss/total": rec["total_loss"]}
    out.update({f"aux/{name}": v for name, v in rec["aux"].items()})
    for kind, v in rec["aux_sum"].items():
        out[f"aux_sum/{kind}"] = v
        out[f"aux_weighted/{kind}"] = rec["aux_weighted"][kind]
    out.update({"lr/adamw": rec["lr"], "lr/muon": rec["muon_lr"], "grad_norm": rec["grad_norm"],
                "throughput/tokens_per_s": rec["tokens_per_s"]})
    return out


class MetricsLogger:
    """Writes records to every sink. Only rank 0 writes metrics.jsonl, TensorBoard and the console."""

    def __init__(self, run_dir: Path, *, rank: int, total_steps: int, tensorboard: bool, progress: bool,
                 start_step: int = 0, trackers: list[Any] = ()) -> None:
        """``start_step``: the optimizer steps the run had done when this process started (its
        checkpoint's step). TensorBoard events an earlier attempt logged after it (steps replayed after
        a crash or a ``resume --checkpoint`` rollback) are purged, so each step shows once.
        ``trackers``: objects with ``log(scalars, step)`` and ``close()`` (``trackers.open_trackers``), fed
        on rank 0 with the scalars TensorBoard gets."""
        self.rank, self.total_steps, self.main = rank, total_steps, rank == 0
        run_dir = Path(run_dir)
        (run_dir / "logs").mkdir(exist_ok=True)
        self._log = (run_dir / "logs" / f"rank{rank}.log").open("a", buffering=1)
        self._jsonl = (run_dir / "metrics.jsonl").open("a", buffering=1) if self.main else None
        self._progress_file = run_dir / "logs" / PROGRESS_FILE if self.main else None
        self._tb = None
        self._trackers = list(trackers) if self.main else []
        if self.main and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self._progress: Any = None
        if self.main and progress and sys.stdout.isatty():
            self._start_progress(run_dir)
        self._t0 = time.monotonic()
        self._steps_timed = 0

    def _start_progress(self, run_dir: Path) -> None:
        """The bars of an in-process run (world size 1) on a terminal: one per stage, as the launcher draws for
        worker processes (``v4launch.live_progress``), fed here directly at every step."""
        self._progress = LiveProgress(run_dir / "metrics.jsonl", {})

    def _line(self, text: str, console: bool = True) -> None:
        stamp = datetime.now().strftime("%H:%M:%S")
        self._log.write(f"{stamp} [rank{self.rank}] {text}\n")
        if self.main and console:
            if self._progress is not None:
                self._progress.progress.console.print(text, highlight=False)
            else:
                print(f"{stamp} {text}", flush=True)

    def _write(self, rec: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec, sort_keys=True) + "\n")

    def step(self, rec: dict[str, Any], *, first_step_this_job: int, show: bool, stage_steps: int | None = None) -> None:
        """Record one training step (``rec`` as documented above); ``show``: also print / write it;
        ``stage_steps``: the steps its stage plans (given: rank 0 replaces ``logs/progress.rank0.json``, whatever
        ``show``; after the record's metrics.jsonl line, so a reader of both never sees the file ahead of the line)."""
        done = rec["step"] - first_step_this_job
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (self.total_steps - rec["step"]) if done > 0 else None
        if self._progress is not None:
            self._progress.update({**rec, "stage_steps": stage_steps})
        if show:
            self._write(rec)
            self._line(summary_line(rec, self.total_steps, eta), console=self._progress is None)
            self._scalars(train_scalars(rec), rec["step"])
        if self._progress_file is not None and stage_steps is not None:
            write_json_atomic(self._progress_file, progress_record(rec, stage_steps))

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        """``scalars`` at ``step`` to TensorBoard and every tracker."""
        if self._tb is not None:
            for tag, v in scalars.items():
                self._tb.add_scalar(tag, v, step)
        for tracker in self._trackers:
            tracker.log(scalars, step)

    def eval(self, rec: dict[str, Any]) -> None:
        """Record a held-out evaluation."""
        self._write(rec)
        when = "after stage" if rec.get("at", "stage_end") == "stage_end" else "in stage"
        self._line(f"eval {when} {rec['stage']} step {rec['step']}: held-out lm loss {rec['lm_loss']:.4f}")
        self._scalars({"eval/lm_loss": rec["lm_loss"]}, rec["step"])

    def event(self, step: int, event: str, text: str, **fields: Any) -> None:
        """A run event (phase change, checkpoint, stop): a log line plus an ``event`` record."""
        self._write({"kind": "event", "step": step, "event": event, **fields})
        self._line(text)

    def close(self) -> None:
        """Stop the display and flush every sink."""
        if self._progress is not None:
            self._progress.progress.stop()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._log.close()
