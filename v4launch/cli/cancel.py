"""`v4launch cancel`: stop a run (every live Slurm job of it, or the local processes)."""

from __future__ import annotations

import shlex

from .common import OUT
from .status import RunArg, resolve_run

HELP = ("Stop RUN: the running job finishes its step, saves a checkpoint and exits; queued jobs of the run "
        "are removed. Recorded in the run's ledger. Continue later with `v4launch resume RUN`. "
        "Exit 0, or 1 when nothing of the run is running.")
EXAMPLES = """Examples:

  v4launch cancel                     # the workspace's newest run

  v4launch cancel runs/tiny_cpu-20261129-140312
"""


def cancel(run: RunArg = None) -> None:
    """Cancel the run's live jobs (Slurm) or signal its processes (local)."""
    from ..launchers import launcher_for

    run_dir = resolve_run(run)
    launcher = launcher_for(run_dir)
    jobs = launcher.live_jobs(run_dir) if hasattr(launcher, "live_jobs") else []
    launcher.cancel(run_dir)
    what = f"Slurm job(s) {', '.join(jobs)}" if jobs else "its processes"
    OUT.console.print(f"cancelled run {run_dir.name}: asked {what} to checkpoint and stop", markup=False)
    OUT.console.print(f"  continue it later with: v4launch resume {shlex.quote(str(run_dir))}", markup=False,
                      soft_wrap=True)
