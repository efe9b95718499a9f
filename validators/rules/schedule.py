"""Pipeline-schedule rules: an interleaved schedule needs pipeline ranks, and enough micro-batches per rank.

The job runs ``torch.distributed.pipelining``'s ``Schedule1F1B`` at vpp = 1 and
``ScheduleInterleaved1F1B`` at vpp > 1 (docs/parallelism.md), with the stage's micro-batches per
rank (global batch / (micro batch · dp)) as ``n_microbatches``.
"""

from __future__ import annotations

from .base import Context, micro_batches, rule
from .world import batch_fix


@rule("V4-PP-VPP", fields=("parallel.vpp", "parallel.pp"), scope="recipe",
      fix="set parallel.vpp=1 parallel.pp_layout=null (one pipeline stage needs no layout); or raise parallel.pp above 1 "
          "with a layout of pp·vpp stages (V4-PP-LAYOUT proposes one)")
def check_vpp_needs_pp(ctx: Context):
    """Virtual pipeline stages (vpp > 1) need more than one pipeline rank (pp > 1).

    Source: Megatron arguments.py (virtual pipeline needs pipeline-model-parallel size > 1); docs/parallelism.md.
    """
    p = ctx.parallel
    if p.vpp == 1:
        return ctx.na("vpp = 1")
    if p.pp == 1:
        return ctx.finding("parallel.vpp", p.vpp, f"vpp={p.vpp} with pp=1: an interleaved schedule has no other "
                           "pipeline rank to interleave with")
    return ctx.ok("parallel.vpp", p.vpp, f"pp={p.pp}")


@rule("V4-PP-MICROBATCHES", fields=("parallel.global_batch_size", "curriculum.stages.*.global_batch_size",
                                    "parallel.micro_batch_size", "parallel.pp", "parallel.vpp"),
      fix="set the global batch to a multiple of micro_batch·dp·pp (at least pp micro-batches per rank)")
def check_pp_microbatches(ctx: Context):
    """Each rank runs at least pp micro-batches per step; with vpp > 1, a multiple of pp.

    Source: torch.distributed.pipelining Schedule1F1B (n_microbatches >= stages); Megatron
    schedules.py forward_backward_pipelining_with_interleaving (count divisible by pp).
    """
    p, dp = ctx.parallel, ctx.dp
    if p.pp == 1 or dp is None:
        return ctx.na("pp = 1" if p.pp == 1 else "DP undefined (V4-WORLD-SIZE)")
    gbs, per_rank = ctx.recipe.stage_global_batch(ctx.stage), p.micro_batch_size * dp
    if gbs % per_rank:
        return ctx.na("global batch not divisible by micro_batch·dp (V4-BATCH)")
    n = gbs // per_rank
    if n >= p.pp and (p.vpp == 1 or n % p.pp == 0):
        return ctx.ok(ctx.global_batch_field, gbs, f"{n} {micro_batches(n)} per rank, pp={p.pp}")
    need = "at least pp" if p.vpp == 1 else "a multiple of pp (interleaved, vpp > 1)"
    return ctx.finding(ctx.global_batch_field, gbs, f"{n} {micro_batches(n)} per rank ({gbs} / (micro_batch {p.micro_batch_size}"
                       f" · dp {dp})); the schedule needs {need} = {p.pp}", batch_fix(ctx, gbs))
