"""One picture of a run, from its ``metrics.jsonl``: ``v4launch plot`` and the ``plot.png`` of each stage end.

Four panels over the optimizer step, every stage boundary marked (a dashed line; a solid red one where the
attention phase changes, labelled with the stage and its phase):

1. LM loss (nats/token) of the logged training steps, one line per stage, and the held-out LM loss of
   every evaluation (stage ends, and every ``logging.eval_interval_steps`` steps), one marked line per stage;
2. the auxiliary losses as ``aux_sum`` records them (raw, before their coefficients): ``balance``,
   ``indexer_kl``, ``mtp``, whichever the run has;
3. throughput (tokens/s of each logged step, rank 0's view of the global batch);
4. memory of rank 0 (GiB): peak GPU memory allocated so far on a GPU, the process's resident host memory.

matplotlib is an optional extra (``pip install 'v4launch[plot]'``), imported only here, when a figure is made,
and drawn on the Agg canvas (no display, no pyplot state). :func:`run_figure` returns the Figure (its lines
hold the series drawn); :func:`write_plot` saves it as a PNG, written aside and renamed into place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UsageError

PLOT_PNG = "plot.png"
"""The picture the job writes into the run directory at each stage end."""

INSTALL_HINT = "pip install 'v4launch[plot]' (or pip install matplotlib)"


@dataclass
class RunMetrics:
    """What a picture needs from ``metrics.jsonl``: train and eval records in step order (the newest record
    of a step wins, so the steps a resume replayed show once), and each stage's first step."""

    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    stages: list[tuple[int, str, str, int]] = field(default_factory=list)  # (index, name, phase, first step)


def read_metrics(run_dir: Path) -> RunMetrics:
    """The records of ``run_dir/metrics.jsonl`` (a line being written, not yet whole, is skipped).

    Raises:
        UsageError: the run has no metrics.jsonl, naming the path.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{path} does not exist: the run has logged nothing yet",
                         hint="start it (`v4launch run`, `v4launch submit`) or name another run")
    train: dict[int, dict] = {}
    evals: dict[tuple[int, str], dict] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "train" and "lm_loss" in rec:
            train[rec["step"]] = rec
        elif rec.get("kind") == "eval":
            evals[(rec["step"], rec.get("at", "stage_end"))] = rec
    out = RunMetrics(train=[train[s] for s in sorted(train)], evals=[evals[k] for k in sorted(evals)])
    for rec in out.train:
        if not out.stages or out.stages[-1][0] != rec["stage_index"]:
            out.stages.append((rec["stage_index"], rec["stage"], rec["phase"], rec["step"]))
    return out


def _matplotlib() -> tuple[Any, Any]:
    """(Figure, FigureCanvasAgg), or a UsageError saying how to install matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("v4launch plot draws with matplotlib, which is not installed in this Python",
                         hint=f"fix: {INSTALL_HINT}") from None
    return Figure, FigureCanvasAgg


def _color(index: int) -> Any:
    from matplotlib import colormaps

    return colormaps["tab10"](index % 10)


def _loss_panel(ax: Any, data: RunMetrics) -> None:
    for index, name, _, _ in data.stages:
        recs = [r for r in data.train if r["stage_index"] == index]
        ax.plot([r["step"] for r in recs], [r["lm_loss"] for r in recs], color=_color(index), lw=1.2,
                label=f"train lm · {name}")
        evals = [r for r in data.evals if r["stage_index"] == index]
        if evals:
            ax.plot([r["step"] for r in evals], [r["lm_loss"] for r in evals], color=_color(index), marker="o",
                    ls="--", lw=1, label=f"held-out · {name}")
    ax.set_ylabel("LM loss (nats/token)")
    ax.legend(fontsize="small", ncols=2)


def _aux_panel(ax: Any, data: RunMetrics) -> None:
    kinds = sorted({k for r in data.train for k in r.get("aux_sum", {})})
    values = []
    for kind in kinds:
        recs = [r for r in data.train if kind in r.get("aux_sum", {})]
        ys = [r["aux_sum"][kind] for r in recs]
        values += ys
        ax.plot([r["step"] for r in recs], ys, lw=1, label=kind)
    if values and min(values) > 0:
        ax.set_yscale("log")
    ax.set_ylabel("aux losses (raw)")
    _legend_or_note(ax, bool(kinds), "no auxiliary losses logged")


def _throughput_panel(ax: Any, data: RunMetrics) -> None:
    ax.plot([r["step"] for r in data.train], [r["tokens_per_s"] for r in data.train], color="tab:green", lw=1,
            label="tokens/s")
    ax.set_ylabel("tokens/s")


MEMORY_SERIES = {"gpu_peak_gib": "peak GPU memory allocated (GiB, rank 0)",
                 "host_rss_gib": "host resident memory (GiB, rank 0)"}
"""Train-record key → the label of its memory line."""


def _memory_panel(ax: Any, data: RunMetrics) -> None:
    drawn = False
    for key, label in MEMORY_SERIES.items():
        recs = [r for r in data.train if r.get(key) is not None]
        if recs:
            ax.plot([r["step"] for r in recs], [r[key] for r in recs], lw=1, label=label)
            drawn = True
    ax.set_ylabel("memory (GiB)")
    ax.set_xlabel("optimizer step")
    _legend_or_note(ax, drawn, "no memory figures in metrics.jsonl")


def _legend_or_note(ax: Any, drawn: bool, note: str) -> None:
    """The panel's legend when it drew a series, else ``note`` written across its middle."""
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center")


def _mark_stages(axes: list[Any], data: RunMetrics) -> None:
    """A vertical line half a step before each stage's first step (solid red where the phase changes),
    labelled ``stage <name> (<phase>)`` (a label starting with '_': kept out of the legends)."""
    for (_, _, old_phase, _), (_, name, phase, first) in zip(data.stages, data.stages[1:]):
        changed = phase != old_phase
        for ax in axes:
            ax.axvline(first - 0.5, color="tab:red" if changed else "0.5", ls="-" if changed else "--", lw=1,
                       label=f"_stage {name} ({phase})")
        axes[0].annotate(f"{name}\n{phase}" if changed else name, (first - 0.5, 1), xycoords=("data", "axes fraction"),
                         xytext=(3, -3), textcoords="offset points", va="top", fontsize="small",
                         color="tab:red" if changed else "0.3")


def run_figure(run_dir: Path) -> Any:
    """The run's picture as a matplotlib Figure on the Agg canvas (module docstring: what each panel holds).

    Raises:
        UsageError: matplotlib is not installed (with the install command), the run has no metrics.jsonl,
            or no training step is logged in it yet.
    """
    run_dir = Path(run_dir)
    figure_cls, canvas_cls = _matplotlib()
    data = read_metrics(run_dir)
    if not data.train:
        raise UsageError(f"{run_dir / 'metrics.jsonl'} holds no training step yet",
                         hint="plot it after its first logged step (logging.interval_steps)")
    fig = figure_cls(figsize=(11, 11))
    canvas_cls(fig)
    axes = list(fig.subplots(4, 1, sharex=True))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.05, top=0.95, hspace=0.08)  # a layout engine: +0.4 s
    _loss_panel(axes[0], data)
    _aux_panel(axes[1], data)
    _throughput_panel(axes[2], data)
    _memory_panel(axes[3], data)
    _mark_stages(axes, data)
    last = data.train[-1]
    fig.suptitle(f"{run_dir.name}: step {last['step']}, stage {last['stage']} ({last['phase']})")
    return fig


def write_plot(run_dir: Path, out: Path | None = None) -> Path:
    """Save :func:`run_figure` as a PNG at ``out`` (default ``run_dir/plot.png``), written to a temporary
    file beside it and renamed, so a reader never sees half a file. Returns the path written.

    Raises:
        UsageError: as :func:`run_figure`, or ``out``'s folder does not exist.
    """
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / PLOT_PNG
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: the folder {out.parent} does not exist", hint="create it, or name another path")
    fig = run_figure(run_dir)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out)
    return out


def stage_end_plot(run_dir: Path, warn: Any) -> Path | None:
    """The job's ``plot.png`` at a stage end (rank 0). Never raises: a failure (matplotlib missing, a
    drawing error) is passed to ``warn(text)`` and the job goes on. Returns the path, or None."""
    try:
        return write_plot(run_dir)
    except Exception as exc:  # a picture must never stop training
        what = exc.message if isinstance(exc, UsageError) else f"{type(exc).__name__}: {exc}"
        warn(f"{PLOT_PNG} not written ({what}); training goes on. Fix: {INSTALL_HINT} if it is missing, or set "
             "logging.plot=false")
        return None
