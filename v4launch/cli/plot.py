"""`v4launch plot`: one PNG of a run's curves (losses, held-out losses, aux losses, tokens/s, memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import OUT
from .status import RunArg, resolve_run

HELP = ("Write a PNG of RUN from its metrics.jsonl: LM loss and held-out loss per stage with the stage and "
        "phase boundaries marked, the aux losses (balance, indexer KL, MTP), tokens/s and memory. Default "
        "output: RUN/plot.png (the job also writes it at each stage end). Needs matplotlib: "
        "pip install 'v4launch\\[plot]'. Exit 0, or 2 when the run or matplotlib is missing.")
EXAMPLES = """Examples:

  v4launch plot                       # the workspace's newest run -> its plot.png

  v4launch plot runs/tiny_cpu-20261129-140312 --out tiny.png
"""

OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="PNG to write; default: RUN/plot.png.",
                                             show_default=False)]


def plot(run: RunArg = None, out: OutOpt = None) -> None:
    """Draw the run's picture and say where it is."""
    from ..plot import write_plot

    path = write_plot(resolve_run(run), out)
    OUT.console.print(f"wrote {path}", markup=False, soft_wrap=True)
