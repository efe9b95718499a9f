"""World-size rules: the parallel degrees multiply to the cluster, experts split over EP, batches split over DP."""

from __future__ import annotations

from math import gcd, lcm

from ..memory_fixes import divisors, with_edits
from ..memory_fixes_whole import whole_recipe_fit
from ..memory_plan import PlanUnavailable, memory_plan
from .base import Context, micro_batches, rule
from .context_parallel import nearest_cp
from .contract import contract_beyond, no_other_failure, searching


@rule("V4-WORLD-SIZE", fields=("cluster.nodes", "cluster.gpus_per_node", "parallel.tp", "parallel.pp", "parallel.cp",
                               "curriculum.stages.*.cp"),
      fix="set cluster.nodes to a count whose nodes·gpus_per_node is a multiple of tp·pp·cp of every stage")
def check_world(ctx: Context):
    """tp × pp × cp × dp equals nodes × GPUs per node (DP is the integer quotient).

    Source: torchtitan ParallelDims (degrees multiply to the world size); Megatron parallel_state.initialize_model_parallel.
    """
    c, p = ctx.recipe.cluster, ctx.parallel
    denom = p.tp * p.pp * ctx.cp
    if ctx.dp is None:
        return ctx.finding("cluster.gpus_per_node", c.gpus_per_node,
                           f"world {c.nodes}·{c.gpus_per_node} = {c.world_size} is not divisible by "
                           f"tp·pp·cp = {p.tp}·{p.pp}·{ctx.cp} = {denom} ({ctx.cp_field})", _nodes_fix(ctx))
    return ctx.ok("cluster.gpus_per_node", c.gpus_per_node, f"world {c.world_size} = {denom}·dp{ctx.dp}")


def _nodes_fix(ctx: Context) -> str:
    """'set cluster.nodes=N': the fewest nodes, at least the recipe's, whose GPUs split into tp·pp·cp in every stage."""
    c, p = ctx.recipe.cluster, ctx.parallel
    need = lcm(*(p.tp * p.pp * ctx.recipe.stage_cp(st) for st in ctx.recipe.curriculum.stages))
    step = need // gcd(need, c.gpus_per_node)  # nodes must be a multiple of this
    nodes = -(-c.nodes // step) * step
    edited = with_edits(ctx.recipe, {"cluster.nodes": nodes})
    batches = {}  # the global batches the new data-parallel sizes no longer split (V4-BATCH, V4-PP-MICROBATCHES)
    for i, st in enumerate(edited.curriculum.stages):
        there = Context(edited, i)
        gbs = edited.stage_global_batch(st)
        value = batch_value(there, gbs)
        if value != gbs:
            batches.setdefault(there.global_batch_field, value)
    extra = "".join(f" {field}={value}" for field, value in batches.items())
    grow = (f"cluster.nodes={nodes}{extra} ({nodes}·{c.gpus_per_node} GPUs split into tp·pp·cp of every stage, "
            f"lcm {need}{'; and the global batch into whole micro-batches' if extra else ''})")
    # a cp that splits neither the world nor seq_len (cp=3 on 32 GPUs) is the odd one out: the nearest cp that fits
    # both first, more nodes the other way; where cp does split seq_len, another degree moved (pp): nodes alone
    other = nearest_cp(ctx) if ctx.stage is not None and ctx.seq_len % ctx.cp else None
    if other:
        return f"set {ctx.cp_field}={other} (the nearest cp dividing the world and seq_len), or {grow}"
    return f"set {grow}"


@rule("V4-EP-EXPERTS", fields=("model.moe.n_routed_experts", "parallel.ep"), scope="recipe",
      fix="set parallel.ep to a divisor of model.moe.n_routed_experts")
def check_ep_experts(ctx: Context):
    """Routed experts are divisible by EP (each EP rank holds the same number of experts).

    Source: Megatron moe_layer / MoEAlltoAllTokenDispatcher (num_local_experts = experts / ep).
    """
    n, ep = ctx.model.moe.n_routed_experts, ctx.parallel.ep
    if n % ep:
        return ctx.finding("parallel.ep", ep, f"{n} routed experts are not divisible by ep={ep}", ep_fix(ctx.recipe))
    return ctx.ok("parallel.ep", ep, f"{n // ep} experts per rank")


@rule("V4-EP-FOLD", fields=("parallel.ep", "parallel.cp", "curriculum.stages.*.cp", "cluster.nodes"),
      fix="choose parallel.ep dividing dp·cp of every stage")
def check_ep_fold(ctx: Context):
    """EP divides dp × cp: expert parallelism folds over the data- and context-parallel ranks.

    Source: Megatron parallel_state (expert groups fold over DP×CP when tp = 1); seed 004 (4N / PP4 / EP8).
    """
    if ctx.dp is None:
        return ctx.na("DP undefined (V4-WORLD-SIZE)")
    ep, fold = ctx.parallel.ep, ctx.dp * ctx.cp
    if fold % ep:
        return ctx.finding("parallel.ep", ep, f"ep={ep} does not divide dp·cp = {ctx.dp}·{ctx.cp} = {fold}",
                           ep_fix(ctx.recipe))
    return ctx.ok("parallel.ep", ep, f"dp·cp = {fold}")


def ep_fix(recipe) -> str:
    """The one fix V4-EP-EXPERTS and V4-EP-FOLD print for an ep that splits the routed experts or dp·cp unevenly:
    ``set parallel.ep=E``, E the largest ep up to the recipe's that divides both the experts and dp·cp = world /
    (tp·pp) (the same in every stage; the experts alone when tp·pp does not divide the world), when E also fits
    the memory plan; else the smallest such ep above the recipe's that fits with nothing else changed (ep=7 on
    flash_4n: 32, its own value, where the whole-recipe search had also moved four stages' cp); else the memory
    rule's whole-recipe fix (:func:`_memory_whole_fix`). While a fix search checks a candidate (``searching()``),
    the plain ``set parallel.ep=E``, so the search never nests."""
    p, experts = recipe.parallel, recipe.model.moe.n_routed_experts
    world = recipe.cluster.world_size
    fold = world // (p.tp * p.pp) if world % (p.tp * p.pp) == 0 else experts
    options = divisors(gcd(fold, experts))  # 1 always divides both
    best = max(d for d in options if d <= p.ep)
    plain = (f"set parallel.ep={best} (the largest ep up to {p.ep} that divides the {experts} routed experts and "
             f"dp·cp = {fold}, the same in every stage)")
    if searching():
        return plain
    above = tuple(sorted(d for d in options if d > p.ep))
    return _memory_whole_fix(recipe, best, plain, above, f"{experts} routed experts and dp·cp = {fold}")


def _fits(recipe, ep: int) -> bool | None:
    """Every stage's memory plan fits with ``parallel.ep=ep`` (None: nothing is planned, a CPU target or a plan
    that cannot be made)."""
    edited = with_edits(recipe, {"parallel.ep": ep})
    try:
        return all(memory_plan(edited, i).fits is not False for i in range(len(recipe.curriculum.stages)))
    except (PlanUnavailable, ValueError, ZeroDivisionError):
        return None


def _memory_whole_fix(recipe, ep: int, plain: str, above: tuple[int, ...] = (), divides: str = "") -> str:
    """``plain`` (set ep) when ``parallel.ep=ep`` also fits the memory plan or nothing is planned (a CPU target,
    a plan that cannot be made); else the first ep of ``above`` (ascending, each dividing ``divides``) that fits
    alone; else, when ep folds but does not fit (V4-MEMORY would send the user to another layout), the memory
    rule's whole-recipe fix, or ``plain`` saying that no layout fits."""
    if _fits(recipe, ep) is not False:
        return plain
    for larger in above:
        if _fits(recipe, larger):
            return (f"set parallel.ep={larger} (the smallest ep above {recipe.parallel.ep} that divides the {divides} "
                    f"and fits the memory plan; {ep}, the largest below, does not fit: V4-MEMORY)")
    whole = whole_recipe_fit(recipe, contract_beyond(recipe))
    if whole is None:
        return plain + "; but then the memory plan does not fit, nor does any layout the search tries (V4-MEMORY)"
    return (f"set {whole.edits_text()} (an ep of {ep} alone would fold over dp·cp but not fit the memory plan "
            f"(V4-MEMORY); with these edits every stage fits, at most {whole.plan.total_bytes / 2**30:.1f} GiB, "
            f"{no_other_failure(with_edits(recipe, whole.edits))})")


@rule("V4-BATCH", fields=("parallel.global_batch_size", "curriculum.stages.*.global_batch_size", "parallel.micro_batch_size",
                           "cluster.nodes", "cluster.gpus_per_node"),
      fix="set the global batch to a multiple of micro_batch_size·dp")
def check_batch(ctx: Context):
    """The global batch is divisible by micro batch × DP (a whole number of micro-batches per rank).

    Source: Megatron training/arguments.py (global batch divisible by micro batch × DP).
    """
    if ctx.dp is None:
        return ctx.na("DP undefined (V4-WORLD-SIZE)")
    gbs, mbs = ctx.recipe.stage_global_batch(ctx.stage), ctx.parallel.micro_batch_size
    if gbs % (mbs * ctx.dp):
        return ctx.finding(ctx.global_batch_field, gbs, f"global batch {gbs} is not divisible by micro_batch·dp = "
                           f"{mbs}·{ctx.dp}", batch_fix(ctx, gbs))
    n = gbs // (mbs * ctx.dp)
    return ctx.ok(ctx.global_batch_field, gbs, f"{n} {micro_batches(n)} per rank")


def batch_value(ctx: Context, gbs: int) -> int:
    """The smallest global batch from ``gbs`` up that every stage reading ``ctx.global_batch_field`` (this stage's own,
    or parallel.global_batch_size for the stages without one) splits into whole micro-batches per rank, at least pp
    of them and a multiple of pp when vpp > 1 (V4-BATCH and V4-PP-MICROBATCHES at once); ``gbs`` when it does."""
    r, p, field = ctx.recipe, ctx.parallel, ctx.global_batch_field
    stages = [ctx.stage] if field.startswith("curriculum.") else \
        [st for st in r.curriculum.stages if not st.global_batch_size]
    step, low = 1, 1
    for dp in {r.stage_dp(st) for st in stages} - {None}:
        per_rank = p.micro_batch_size * dp
        step = lcm(step, per_rank * (p.pp if p.vpp > 1 else 1))
        low = max(low, per_rank * p.pp)
    return -(-max(gbs, low) // step) * step


def batch_fix(ctx: Context, gbs: int) -> str:
    """'set FIELD=N (…)' with N = ``batch_value``: the fix V4-BATCH and V4-PP-MICROBATCHES both print."""
    p, field = ctx.parallel, ctx.global_batch_field
    need = f", at least pp = {p.pp} per rank" + (" and a multiple of it" if p.vpp > 1 else "") if p.pp > 1 else ""
    where = "this stage" if field.startswith("curriculum.") else "every stage without its own global_batch_size"
    return (f"set {field}={batch_value(ctx, gbs)} (the smallest global batch from {gbs} up that {where} splits into "
            f"whole micro-batches{need})")
