"""Context-parallel rules: packed THD input, contiguous partition, boundary rows, GPU gates."""

from __future__ import annotations

from ..derived import boundary_width, local_rows
from ..memory_fixes import divisors
from .base import Context, rule


def nearest_cp(ctx: Context) -> int | None:
    """The CP size nearest the stage's (the larger of two as near) that the world splits into (it divides
    world / (tp·pp)) and that divides seq_len in every stage the same CP field sets; None when only 1 does (or the
    stage's own cp already fits). What V4-WORLD-SIZE and V4-CP-DIVISIBLE offer first when cp is the odd one out."""
    r, p = ctx.recipe, ctx.parallel
    world, model = r.cluster.world_size, p.tp * p.pp
    if world % model:
        return None
    own = ctx.stage is not None and ctx.stage.cp is not None
    stages = [ctx.stage] if own else [st for st in r.curriculum.stages if st.cp is None]
    fits = [d for d in divisors(world // model) if d > 1 and all(st.seq_len % d == 0 for st in stages)]
    best = min(fits, key=lambda d: (abs(d - ctx.cp), -d), default=None)
    return None if best == ctx.cp else best


CP_CUTE_SMS = frozenset({90, 100, 103})
"""Compute capabilities the CSA CP CuTeDSL kernels accept (sm_90a, sm_100a, sm_103a)."""


@rule("V4-CP-THD", fields=("parallel.qkv_format", "parallel.cp", "curriculum.stages.*.cp"),
      fix="set parallel.qkv_format=thd (packed sequences; CP=1 for the stage is the other way out)")
def check_cp_thd(ctx: Context):
    """CP > 1 requires packed THD input (qkv_format=thd); BSHD is rejected.

    Source: Megatron deepseek_v4_hybrid_attention.py:266-271, csa.py:2103 and transformer_config.py:1566-1574; seed 000 §6.
    """
    if ctx.cp == 1:
        return ctx.na("CP = 1")
    fmt = ctx.parallel.qkv_format
    if fmt != "thd":
        return ctx.finding("parallel.qkv_format", fmt, f"CP={ctx.cp} ({ctx.cp_field}) with qkv_format={fmt}")
    return ctx.ok("parallel.qkv_format", fmt)


@rule("V4-CP-CONTIGUOUS", fields=("parallel.cp_partition", "parallel.cp", "curriculum.stages.*.cp"),
      fix="set parallel.cp_partition=contiguous")
def check_cp_contiguous(ctx: Context):
    """CP > 1 requires the contiguous token partition; zigzag is rejected.

    Source: Megatron transformer_config.py:1611-1616 and csa.py:2103-2109; seed 000 §5 and §6.
    """
    if ctx.cp == 1:
        return ctx.na("CP = 1")
    mode = ctx.parallel.cp_partition
    if mode != "contiguous":
        return ctx.finding("parallel.cp_partition", mode, f"CP={ctx.cp} with the {mode} partition")
    return ctx.ok("parallel.cp_partition", mode)


@rule("V4-CP-SM", fields=("cluster.gpu", "parallel.cp", "curriculum.stages.*.cp", "model.compress_ratios"),
      fix="target SM90/SM100/SM103 GPUs (H100, H200, B200, GB200, B300, GB300) or run this stage with CP=1")
def check_cp_sm(ctx: Context):
    """CP with ratio-4 layers needs sm_90a, sm_100a or sm_103a (CSA CP CuTeDSL kernels); CPU runs use the reference path.

    Source: Megatron csa_utils/cp_layout_kernels.py:591-623; megatron-v4-contract §1.B11.
    """
    if ctx.cp == 1 or 4 not in ctx.all_ratios:
        return ctx.na("CP = 1 or no ratio-4 layer")
    if ctx.sm is None:
        return ctx.na("CPU target (gloo, reference CP path)")
    if ctx.sm not in CP_CUTE_SMS:
        return ctx.finding("cluster.gpu", ctx.recipe.cluster.gpu, f"CP={ctx.cp} with CSA layers on SM{ctx.sm}")
    return ctx.ok("cluster.gpu", ctx.recipe.cluster.gpu, f"SM{ctx.sm}")


@rule("V4-CP-BOUNDARY", fields=("curriculum.stages.*.seq_len", "parallel.cp", "curriculum.stages.*.cp",
                                "model.window_size", "model.compress_ratios"),
      fix="lower CP for this stage or raise its seq_len so seq_len/cp ≥ the boundary width")
def check_cp_boundary(ctx: Context):
    """Local rows per CP rank (seq_len / cp) must be at least the boundary width max(window, d_comp).

    Source: Megatron csa_utils/cp_utils.py:135-139 and :198-199; seed 000 §5.1.
    """
    if ctx.cp == 1:
        return ctx.na("CP = 1")
    width = boundary_width(ctx.model.window_size, ctx.all_ratios)
    rows = local_rows(ctx.seq_len, ctx.cp)
    if rows < width:
        return ctx.finding(ctx.stage_path("seq_len"), ctx.seq_len,
                           f"seq_len/cp = {ctx.seq_len}/{ctx.cp} = {rows} local rows < boundary width {width}")
    return ctx.ok(ctx.stage_path("seq_len"), ctx.seq_len, f"{rows} local rows ≥ {width}")


@rule("V4-CP-DIVISIBLE", fields=("curriculum.stages.*.seq_len", "parallel.cp", "curriculum.stages.*.cp"),
      fix="set the stage's seq_len to a multiple of its CP size")
def check_cp_divisible(ctx: Context):
    """seq_len must be divisible by CP (every rank holds the same number of contiguous rows).

    Source: Megatron datasets/data_schedule_utils.py:79-84; megatron-v4-contract §1.B13.
    """
    if ctx.cp == 1:
        return ctx.na("CP = 1")
    if ctx.seq_len % ctx.cp:
        up = -(-ctx.seq_len // ctx.cp) * ctx.cp
        other = nearest_cp(ctx)
        keep = (f", or {ctx.stage_path('seq_len')}={up} (the next multiple of cp={ctx.cp})" if other else
                f"{ctx.stage_path('seq_len')}={up} (the next multiple of cp={ctx.cp})")
        fix = (f"set {ctx.cp_field}={other} (the nearest cp dividing seq_len and the world){keep}" if other else
               f"set {keep}")
        return ctx.finding(ctx.stage_path("seq_len"), ctx.seq_len, f"seq_len {ctx.seq_len} is not divisible by cp={ctx.cp}",
                           fix)
    return ctx.ok(ctx.stage_path("seq_len"), ctx.seq_len)


@rule("V4-CP-MICRO-BATCH", fields=("parallel.micro_batch_size", "parallel.cp", "curriculum.stages.*.cp"),
      fix="set parallel.micro_batch_size=1 (pack more tokens into seq_len instead)")
def check_cp_micro_batch(ctx: Context):
    """CP > 1 needs micro_batch_size 1: the CP indexer path expects one packed sequence (bsz = 1).

    Source: Megatron csa.py:2558-2626 ("expects bsz=1"); megatron-v4-contract §1.B9.
    """
    if ctx.cp == 1:
        return ctx.na("CP = 1")
    mbs = ctx.parallel.micro_batch_size
    if mbs != 1:
        return ctx.finding("parallel.micro_batch_size", mbs, f"micro_batch_size={mbs} with CP={ctx.cp}")
    return ctx.ok("parallel.micro_batch_size", mbs)
