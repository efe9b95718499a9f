"""`v4launch status`: where a run stands; for Slurm runs one table across all the run's jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .common import OUT, JsonOpt

HELP = ("Show where RUN stands: state, stage, phase, step, last loss, last checkpoint and restarts; for a "
        "Slurm run one row per job (every stage and requeue). Exit 0, or 1 when the run failed.")
EXAMPLES = """Examples:

  v4launch status                     # the workspace's newest run

  v4launch status runs/tiny_cpu-20261129-140312

  v4launch status --json | jq .state
"""

RunArg = Annotated[str | None, typer.Argument(help="Run directory (or its name under the workspace's runs/); "
                                                   "default: the workspace's newest run.", show_default=False)]

_STYLE = {"running": "green", "pending": "cyan", "requeued": "yellow", "completed": "bold green",
          "stage completed": "green", "failed": "bold red", "node failure": "red", "timeout": "red",
          "cancelled": "magenta", "stopped": "magenta", "preempted": "yellow"}
FAILED = ("failed", "died", "node failure", "timeout")


def resolve_run(run: str | None) -> Path:
    """The run directory named by ``run`` (a path, or a name under the workspace's runs/), or the
    workspace's newest run (said on stderr).

    Raises:
        UsageError: no such run directory / no run in the workspace.
    """
    from ..rundir import read_run_json
    from ..workspace import Workspace

    ws = Workspace.current()
    if run is None:
        path = ws.newest_run()
        OUT.note(f"run: {path} (the workspace's newest)")
    else:
        path = Path(run)
        if not path.is_dir() and (ws.runs_root() / run).is_dir():
            path = ws.runs_root() / run
    read_run_json(path)  # raises a UsageError with a hint when it is not a run directory
    return path.resolve()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _rows(run_dir: Path, st: Any) -> list[dict[str, Any]]:
    from ..launcher_base import last_metrics

    rows = st.detail.get("jobs")
    if rows is not None:
        return rows
    ckpt = st.checkpoint.name if st.checkpoint else None  # a local run: one row from the launcher's view
    last = last_metrics(run_dir) or {}  # phase and loss of the last logged step
    return [{"job_id": ",".join(map(str, st.detail.get("pids", []))) or "-", "state": st.state,
             "stage": st.stage, "phase": last.get("phase"), "step": st.step, "loss": last.get("lm_loss"),
             "checkpoint": ckpt, "restarts": 0, "detail": ""}]


def _loss_cell(loss: Any, step: Any, logged_step: Any) -> str:
    """The loss is the last logged step's (every ``logging.interval_steps``): its step is said when it is not
    the row's step (a run stopped at step 19 showed step 19 beside step 10's loss)."""
    if loss is None or logged_step is None or logged_step == step:
        return _cell(loss)
    return f"{_cell(loss)} (step {logged_step})"


def _table(run_dir: Path, st: Any, rows: list[dict[str, Any]]) -> Table:
    from ..launcher_base import last_metrics

    logged_step = (last_metrics(run_dir) or {}).get("step")  # the step the loss column comes from
    table = Table(title=f"{run_dir.name} ({st.launcher})", title_justify="left")
    first = "job" if st.detail.get("jobs") is not None else "pid"  # Slurm job ids, or a local run's process ids
    for col in (first, "state", "stage", "phase", "step", "loss", "checkpoint", "restarts"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        style = _STYLE.get(r["state"], "")
        table.add_row(_cell(r["job_id"]), f"[{style}]{r['state']}[/{style}]" if style else r["state"],
                      _cell(r["stage"]), _cell(r["phase"]), _cell(r["step"]),
                      _loss_cell(r["loss"], r["step"], logged_step), _cell(r["checkpoint"]), _cell(r["restarts"]))
    return table


def _job_ids(st: Any) -> list[str]:
    """The Slurm job ids of the run's chain (stages and relaunches), oldest first; [] for a local run."""
    return [str(r["job_id"]) for r in st.detail.get("jobs") or []]


def status(run: RunArg = None, json_out: JsonOpt = False) -> None:
    """Print the run's state (rich table, or JSON with --json)."""
    from ..checkpoints.listing import list_set_aside
    from ..launchers import launcher_for

    run_dir = resolve_run(run)
    st = launcher_for(run_dir).status(run_dir)
    set_aside = list_set_aside(run_dir / "checkpoints")  # by resume --checkpoint
    if json_out:
        OUT.json({"run_dir": str(run_dir), "state": st.state, "launcher": st.launcher, "stage": st.stage,
                  "step": st.step, "checkpoint": str(st.checkpoint) if st.checkpoint else None,
                  "set_aside": set_aside, "job_ids": _job_ids(st), **st.detail})
    else:
        rows = _rows(run_dir, st)
        OUT.console.print(_table(run_dir, st, rows))
        for r in rows:
            if r.get("detail"):
                OUT.console.print(f"  job {r['job_id']}: {r['detail']}", markup=False, highlight=False)
        if _job_ids(st):
            OUT.console.print(f"Slurm jobs: {' -> '.join(_job_ids(st))}", markup=False, highlight=False)
        if st.detail.get("launcher_gone"):
            OUT.console.print(f"note: {st.detail['launcher_gone']}", markup=False, highlight=False)
        restarts = st.detail.get("restarts")
        budget = (f"; restarts {restarts}: {st.detail.get('segments', 0)} planned (time limit, preemption), "
                  f"{st.detail.get('failures', 0)} failure(s) of slurm.max_restarts={st.detail.get('max_restarts')}"
                  if restarts is not None else "")
        OUT.console.print(f"run state: [bold]{st.state}[/bold] (stage {_cell(st.stage)}, step {_cell(st.step)}{budget})")
        if set_aside:
            OUT.console.print(f"rolled back: {', '.join(set_aside)} set aside by `resume --checkpoint` (kept, never "
                              "taken as the latest; rename one back to step_* to use it)", markup=False, highlight=False)
        if st.detail.get("failure"):
            OUT.console.print(f"why: {st.detail['failure']}", style="red", markup=False, highlight=False)
        if st.detail.get("cancelled_by"):
            then = (f"continue with `v4launch resume {run_dir}`" if st.checkpoint is not None else
                    f"nothing saved: start it again with `v4launch run {run_dir / 'recipe.yaml'}`")
            OUT.console.print(f"cancelled by {st.detail['cancelled_by']}; {then}", markup=False, highlight=False)
        if st.detail.get("log_tail"):
            OUT.console.print(f"last lines of {st.detail.get('log')}:", style="red")
            OUT.console.print("\n".join(st.detail["log_tail"]), markup=False, highlight=False)
    if st.state in FAILED:
        raise typer.Exit(1)
