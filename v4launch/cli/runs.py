"""`v4launch runs`: the workspace's runs, one line each (name, state, stage, step, last loss, start, Slurm jobs)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .common import OUT, JsonOpt

HELP = ("List the runs of the workspace (its runs/ folder, or --root): name, state as `v4launch status` reads it, "
        "stage, step, last logged loss, start time (UTC) and the run's Slurm job ids. A table on a terminal, plain "
        "aligned columns otherwise, JSON with --json. Exit 0.")
EXAMPLES = """Examples:

  v4launch runs

  v4launch runs --json | jq -r '.[] | select(.state == "running") | .name'

  v4launch runs --root /scratch/me/runs
"""

RootOpt = Annotated[str | None, typer.Option("--root", help="Folder holding run directories (default: the "
                                                          "workspace's runs/).", show_default=False)]
COLUMNS = ("name", "state", "stage", "step", "loss", "started", "slurm jobs")


def _cells(r: dict[str, Any]) -> list[str]:
    loss = "-" if r["loss"] is None else f"{r['loss']:.3f}"
    started = (r["started"] or "-").replace("T", " ").removesuffix("+00:00")
    jobs = ",".join(r["slurm_job_ids"]) or "-"
    return [r["name"], r["state"], r["stage"] or "-", "-" if r["step"] is None else str(r["step"]), loss, started, jobs]


def runs(root: RootOpt = None, json_out: JsonOpt = False) -> None:
    """Print the workspace's runs (oldest first)."""
    from pathlib import Path

    from rich.table import Table
    from rich.text import Text

    from ..launchers import list_runs
    from ..workspace import Workspace

    folder = Path(root) if root else Workspace.current().runs_root()
    rows = list_runs(folder)
    if json_out:
        OUT.json(rows)
        return
    if not rows:
        OUT.note(f"no runs under {folder}: start one with `v4launch run RECIPE` or `v4launch submit RECIPE`")
        return
    cells = [_cells(r) for r in rows]
    if OUT.console.is_terminal:
        table = Table(title=f"runs in {folder}", title_justify="left")
        longest = max(len(row[0]) for row in cells)  # a name is what one copies: never cut; a narrow terminal
        for col in COLUMNS:  # folds the stage, start time and job ids instead
            if col in ("stage", "started", "slurm jobs"):
                table.add_column(col, overflow="fold")
            else:
                table.add_column(col, no_wrap=True, min_width=longest if col == "name" else None)
        for row in cells:
            table.add_row(*map(Text, row))  # names are text, never markup
        OUT.console.print(table)
        return
    widths = [max(len(c) for c in col) for col in zip(COLUMNS, *cells)]
    for row in (COLUMNS, *cells):  # plain aligned columns: grep / awk / cut friendly
        OUT.console.print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), markup=False, highlight=False,
                          soft_wrap=True)
