"""Slurm budget rules that read the time plan: a stage's estimated wall time fits the segments the recipe allows."""

from __future__ import annotations

from math import ceil

from ..time_plan import duration_text, segment_seconds, stage_time
from .base import Context, rule


@rule("V4-SLURM-SEGMENTS", fields=("slurm.max_segments", "slurm.time_min", "slurm.signal_delay_s"),
      severity="warning",
      fix="raise slurm.max_segments to the segments the stage needs (or null), or raise slurm.time_min")
def check_segments(ctx: Context):
    """A stage's estimated wall time fits in slurm.max_segments Slurm jobs of slurm.time_min each.

    Source: validators/time_plan.py (the stage's steps x estimated step time); docs/slurm.md (a time-limit
    requeue is a planned segment, stopped at slurm.max_segments; slurm.max_restarts counts failures only).
    """
    est = stage_time(ctx.recipe, ctx.index)
    if est is None:
        return ctx.na("no time estimate (a CPU target, or DP undefined: V4-WORLD-SIZE)")
    s = ctx.recipe.slurm
    usable = segment_seconds(ctx.recipe)
    note = f"{est.segments} segment(s) of {s.time_min} min for ~{duration_text(est.wall_s)}"
    if s.max_segments is None or est.segments <= s.max_segments:
        cap = "no cap" if s.max_segments is None else f"cap {s.max_segments}"
        return ctx.ok("slurm.max_segments", s.max_segments, f"{note} ({cap})")
    need, minutes = _whole_curriculum(ctx.recipe)
    time_fix = f", or slurm.time_min={minutes} (if the partition allows jobs that long)" if minutes <= 525_600 else ""
    return ctx.finding(
        "slurm.max_segments", s.max_segments,
        f"stage {ctx.stage.name} needs ~{duration_text(est.wall_s)} ({est.steps} steps x {est.step_s:.1f} s, estimated): "
        f"{est.segments} Slurm jobs of {usable / 60:.0f} min of training each (slurm.time_min={s.time_min} less "
        f"slurm.signal_delay_s={s.signal_delay_s} s), but slurm.max_segments={s.max_segments} stops the run "
        f"after {s.max_segments}",
        fix=f"set slurm.max_segments={need} (the estimate's count for the longest stage; more for slower "
            f"steps){time_fix}")


def _whole_curriculum(recipe) -> tuple[int, int]:
    """(segments of the longest stage, the slurm.time_min in minutes that fits every stage in
    slurm.max_segments jobs): one fix for every stage the rule warns about."""
    estimates = [stage_time(recipe, i) for i in range(len(recipe.curriculum.stages))]
    walls = [e.wall_s for e in estimates if e is not None]
    s = recipe.slurm
    return (max(e.segments for e in estimates if e is not None),
            ceil((max(walls) / s.max_segments + s.signal_delay_s) / 60))
