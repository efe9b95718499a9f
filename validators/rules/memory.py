"""Memory rule: every curriculum stage fits the GPU's memory on every pipeline rank (plan: memory_plan.py)."""

from __future__ import annotations

from ..memory_fixes import fit_proposals, with_edits
from ..memory_fixes_whole import forcing_stage, whole_recipe_fit
from ..memory_plan import GIB, HEADROOM_FIXED_BYTES, PlanUnavailable, budget_bytes, memory_plan
from .base import Context, rule
from .contract import contract_beyond, no_other_failure


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@rule("V4-MEMORY", fields=("cluster.gpu_memory_gib", "cluster.gpu", "cluster.nodes", "curriculum.stages.*.seq_len",
                           "curriculum.stages.*.cp", "parallel.pp", "parallel.ep", "parallel.distributed_optimizer",
                           "parallel.micro_batch_size", "parallel.global_batch_size", "parallel.recompute_modules",
                           "parallel.recompute_granularity", "parallel.pp_layout", "precision.keep_fp32_params",
                           "precision.params_dtype", "precision.store_param_remainders", "precision.exp_avg_dtype",
                           "precision.exp_avg_sq_dtype", "parallel.cpu_offloading",
                           "curriculum.stages.*.global_batch_size"),
      fix="more context parallelism for the stage, more pp or ep, the distributed optimizer, selective or "
          "whole-layer recompute, bf16 storage (precision.params_dtype), host offload (parallel.cpu_offloading), "
          "or more nodes (the rule proposes the edits)")
def check_memory(ctx: Context):
    """The per-rank memory plan of a stage (parameters, gradients, optimizer, activations, CP buffers, loss, headroom) fits the GPU.

    Source: docs/memory-plan.md (the plan, calibrated against torch.cuda.max_memory_allocated on an H200); validators/memory_plan.py.
    """
    try:
        plan = memory_plan(ctx.recipe, ctx.index)
    except PlanUnavailable as exc:
        return ctx.na(f"no memory plan: {exc}")
    budget, field = plan.budget_bytes, "cluster.gpu_memory_gib"
    if budget is None:
        return ctx.na("CPU target: set cluster.gpu_memory_gib to plan host memory per process")
    where = f"pipeline rank {plan.pp_rank}, {plan.in_flight} micro-batch forward(s) in flight, {plan.rows} rows"
    if plan.fits:
        return ctx.ok(field, round(budget / GIB, 1), f"peak {_gib(plan.total_bytes)} of {_gib(budget)} ({where})")
    top = ", ".join(f"{t.label} {_gib(t.bytes)}" for t in plan.largest(3, without=("headroom",)))
    fix = _fix_text(ctx, budget)
    return ctx.finding(field, round(budget / GIB, 1),
                       f"stage {plan.stage_name} needs {_gib(plan.total_bytes)} per GPU > {_gib(budget)} ({where}); "
                       f"largest: {top}", fix)


def _fix_text(ctx: Context, budget: int) -> str:
    """The fix of an over-budget stage: edits on the recipe's nodes that make this stage fit, else one set of
    edits for the whole curriculum (``memory_fixes_whole.whole_recipe_fit``), else what is left to change."""
    contract = contract_beyond(ctx.recipe)  # failures the recipe already has, left as they are, do not count
    found = fit_proposals(ctx.recipe, ctx.index, contract)
    if found:
        return "set " + ", or ".join(p.text() for p in found)
    whole = whole_recipe_fit(ctx.recipe, contract)
    if whole is None and budget <= HEADROOM_FIXED_BYTES:
        return (f"the budget {_gib(budget)} is below the plan's fixed headroom ({_gib(HEADROOM_FIXED_BYTES)}: CUDA "
                "context, Triton, NCCL), which no layout changes: raise cluster.gpu_memory_gib or unset it (the GPU "
                "model's memory)")
    if whole is None:
        return (f"no pp, cp, ep, distributed_optimizer, recompute or node count up to 64x fits {_gib(budget)}: "
                f"shorten curriculum.stages.{ctx.index}.seq_len or use GPUs with more memory (cluster.gpu)")
    nodes = whole.edits.get("cluster.nodes", ctx.recipe.cluster.nodes)
    grows = any("global_batch_size" in k for k in whole.edits)
    return (f"set {whole.edits_text()} (every stage then fits, at most {_gib(whole.plan.total_bytes)} in stage "
            f"{whole.plan.stage_name}, {no_other_failure(with_edits(ctx.recipe, whole.edits))})"
            + (f"; nothing fits on the recipe's {ctx.recipe.cluster.nodes} node(s), {nodes} is the fewest"
               + _forcing(ctx.recipe) if nodes != ctx.recipe.cluster.nodes else "")
            + ("; the larger global batches keep every stage's batch divisible over the new dp, so tokens "
               "per step grow too" if grows else ""))


def _forcing(recipe) -> str:
    """``: stage X needs N GiB there …`` naming the stage that keeps the recipe off its nodes and the limit it meets
    (GPU memory, or the node's host memory when the GPU figure fits), or ""."""
    found = forcing_stage(recipe)
    if found is None:
        return ""
    name, gib, pp, host = found
    levers = "bf16 storage, host offload, whole-layer recompute, FSDP, the largest ep and its largest cp"
    budget, host_budget = budget_bytes(recipe), recipe.cluster.host_memory_gib
    if budget is not None and gib * GIB <= budget and host_budget is not None and host > host_budget:
        return (f": stage {name} fits the GPU there only with host offload ({levers}; pp {pp}: {gib:.1f} GiB per "
                f"GPU), which needs {host:.0f} GiB of host memory per node > cluster.host_memory_gib = {host_budget:g}")
    return f": stage {name} needs {gib:.1f} GiB per GPU there even with {levers} (pp {pp})"
