"""`v4launch logs`: print (or follow) a run's logs, across all its Slurm jobs."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .status import RunArg, resolve_run

HELP = ("Print RUN's logs as plain text: for a Slurm run rank 0's job logs of every job (stages and "
        "requeues) in order, for a local run the rank logs (rank 0 first). --rank N shows one rank's log, "
        "--tail K only the last K lines of each log, --follow keeps printing until the run ends.")
EXAMPLES = """Examples:

  v4launch logs                       # the workspace's newest run

  v4launch logs runs/tiny_cpu-20261129-140312 --rank 1 --tail 20

  v4launch logs --tail 0 --follow     # only what the run writes from now on

  v4launch logs | grep -i loss
"""

FollowOpt = Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run ends.")]
RankOpt = Annotated[int | None, typer.Option("--rank", "-r", min=0, help="Only this rank's log (0 .. world size - 1).",
                                             show_default=False)]
TailOpt = Annotated[int | None, typer.Option("--tail", "-n", min=0, help="Only the last K lines of each log (then, "
                                             "with --follow, what is written after).", show_default=False)]


def logs(run: RunArg = None, rank: RankOpt = None, tail: TailOpt = None, follow: FollowOpt = False) -> None:
    """Write the run's log lines to stdout (plain, pipeable)."""
    from ..launchers import launcher_for

    run_dir = resolve_run(run)
    try:
        for line in launcher_for(run_dir).logs(run_dir, follow=follow, rank=rank, tail=tail):
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    except BrokenPipeError:  # `v4launch logs | head`
        raise typer.Exit(0) from None
