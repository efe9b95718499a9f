"""Slurm job-time rules: what ``v4launch submit`` asks of Slurm must be possible within one job."""

from __future__ import annotations

from .base import Context, rule

SIGNAL_EARLY_S = 60
"""sbatch(1): the ``--signal=SIG@T`` signal may come up to 60 s earlier than asked."""


@rule("V4-SLURM-SIGNAL", fields=("slurm.signal_delay_s", "slurm.time_min"), scope="recipe",
      fix="set slurm.signal_delay_s below slurm.time_min·60 (default 120), or raise slurm.time_min")
def check_signal_before_limit(ctx: Context):
    """The checkpoint signal (slurm.signal_delay_s before the limit) falls inside the job's time limit (slurm.time_min).

    Source: sbatch(1) --signal=SIG@TIME and --time; docs/slurm.md (Preemption, time limits and restarts).
    A signal due at or before the job's start would stop every job at its first step: a run that never advances.
    """
    s = ctx.recipe.slurm
    limit_s = s.time_min * 60
    if s.signal_delay_s >= limit_s:
        keep = max(10, min(120, limit_s // 2))
        return ctx.finding("slurm.signal_delay_s", s.signal_delay_s,
                           f"slurm.signal_delay_s={s.signal_delay_s} s is at or above the time limit "
                           f"slurm.time_min={s.time_min} min = {limit_s} s: the checkpoint signal would be due "
                           "before the job starts, so every job would save and stop at once",
                           fix=f"set slurm.signal_delay_s={keep} (below {limit_s} s; Slurm may send it up to "
                               f"{SIGNAL_EARLY_S} s early), or slurm.time_min={-(-(s.signal_delay_s + 600) // 60)}")
    return ctx.ok("slurm.signal_delay_s", s.signal_delay_s, f"{limit_s - s.signal_delay_s} s of training before it")
