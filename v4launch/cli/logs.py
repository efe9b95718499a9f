"""`v4launch logs`: print (or follow) a run's logs, across all its Slurm jobs."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .status import RunArg, resolve_run

HELP = ("Print RUN's logs as plain text: for a Slurm run rank 0's job logs of every job (stages and "
        "requeues) in order, for a local run the rank logs. --follow keeps printing until the run ends.")
EXAMPLES = """Examples:

  v4launch logs                       # the workspace's newest run

  v4launch logs runs/tiny_cpu-20261129-140312 --follow

  v4launch logs | grep -i loss
"""

FollowOpt = Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run ends.")]


def logs(run: RunArg = None, follow: FollowOpt = False) -> None:
    """Write the run's log lines to stdout (plain, pipeable)."""
    from ..launchers import launcher_for

    run_dir = resolve_run(run)
    try:
        for line in launcher_for(run_dir).logs(run_dir, follow=follow):
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    except BrokenPipeError:  # `v4launch logs | head`
        raise typer.Exit(0) from None
