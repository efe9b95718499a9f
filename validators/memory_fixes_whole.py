"""The whole-recipe fix V4-MEMORY proposes when nothing on the recipe's nodes fits (pure Python).

:func:`whole_recipe_fit` proposes one set of edits for the whole curriculum: the fewest nodes (1, 2, 4, … 64 times
the recipe's), the lightest storage that fits (the recipe's, then ``BF16_STORAGE``, then with ``OFFLOAD``), a
pipeline size, the largest ep, the distributed optimizer, whole-layer recompute, one row per micro-batch and each
stage's smallest cp that fits; global batches grow where the new dp needs it. The per-stage fixes, the edit
helpers and the ``Contract`` check it shares are in ``memory_fixes.py``; this module imports that one, never the
reverse.
"""

from __future__ import annotations

from math import gcd
from typing import Any

from .cost_model import propose_layout, unit_costs
from .memory_fixes import (BF16_STORAGE, FULL_RECOMPUTE, OFFLOAD, STORAGE_STEPS, Contract, Proposal, changed_edits,
                           cp_ok, divisors, graph_compatible, stage_fits, with_edits)
from .memory_plan import PlanUnavailable, memory_plan
from .memory_storage import host_bytes_per_node
from .schema.recipe import Recipe

MAX_NODE_SCALE = 64
"""Largest multiple of the recipe's nodes a proposal considers."""


_CACHE: dict[int, tuple[Recipe, Contract, Proposal | None]] = {}


def whole_recipe_fit(recipe: Recipe, contract: Contract) -> Proposal | None:
    """One set of edits under which every stage fits and no other error rule fails (``contract``), else None.

    Search order (the first that works is returned): the recipe's nodes, then 2, 4, … ``MAX_NODE_SCALE`` times
    as many, then the powers of two above the recipe's nodes (:func:`_node_counts`); at each, the recipe's
    storage, then ``BF16_STORAGE``, then that with ``OFFLOAD``; at each of those, the recipe's pp first, then 1,
    2, 4, … (a balanced ``pp_layout`` from the cost model when pp changes); the largest ep dividing the experts
    and the pipeline rank's ranks (fewest experts per GPU); the distributed optimizer and whole-layer recompute;
    per stage the smallest cp that fits (the most data parallelism); the global batches doubled until every
    stage splits them over its dp into enough micro-batches for the schedule. ``Proposal.plan`` is the plan of
    the stage that needs the most.
    Cached per recipe object (every failing stage of one validate run shares the answer).
    """
    hit = _CACHE.get(id(recipe))
    if hit is not None and hit[0] is recipe and hit[1] is contract:
        return hit[2]
    if len(_CACHE) > 8:
        _CACHE.clear()
    found = None
    layouts: dict[int, str | None] = {}  # balanced layout per pp·vpp: the same at every node count and storage
    for nodes in _node_counts(recipe.cluster.nodes):
        for extra in STORAGE_STEPS:  # the lightest storage that fits
            for pp in _pp_candidates(recipe, nodes):
                found = _whole_fit_at(recipe, nodes, pp, extra, contract, layouts)
                if found is not None:
                    break
            if found is not None:
                break
        if found is not None:
            break
    _CACHE[id(recipe)] = (recipe, contract, found)
    return found


def _node_counts(nodes: int) -> list[int]:
    """Node counts the whole-recipe search tries, in order: ``nodes`` times 1, 2, 4 … ``MAX_NODE_SCALE``, then the
    powers of two from ``nodes`` up to that bound (6 nodes cannot split a 64-way CP stage at any doubling; 8 can)."""
    scaled = [nodes * 2 ** i for i in range(MAX_NODE_SCALE.bit_length()) if 2 ** i <= MAX_NODE_SCALE]
    powers = [2 ** i for i in range((nodes * MAX_NODE_SCALE).bit_length()) if nodes < 2 ** i <= nodes * MAX_NODE_SCALE]
    return scaled + [n for n in powers if n not in scaled]


def _pp_candidates(recipe: Recipe, nodes: int) -> list[int]:
    p, m = recipe.parallel, recipe.model
    world = nodes * recipe.cluster.gpus_per_node
    out = [p.pp] + [pp for pp in (1, 2, 4, 8, 16, 32) if pp != p.pp]
    return [pp for pp in out if world % (p.tp * pp) == 0 and pp * (p.vpp if pp > 1 else 1) <= m.n_layers]


def _whole_fit_at(recipe: Recipe, nodes: int, pp: int, extra: dict[str, Any], contract: Contract,
                  layouts: dict[int, str | None]) -> Proposal | None:
    p, c, m = recipe.parallel, recipe.cluster, recipe.model
    shard = nodes * c.gpus_per_node // (p.tp * pp)
    vpp = p.vpp if pp > 1 else 1
    edits: dict[str, Any] = {"cluster.nodes": nodes, "parallel.pp": pp, "parallel.vpp": vpp,
                             "parallel.ep": max(divisors(gcd(m.moe.n_routed_experts, shard))),
                             "parallel.distributed_optimizer": True, **FULL_RECOMPUTE, **extra}
    if pp * vpp == 1:
        edits["parallel.pp_layout"] = None
    elif pp != p.pp or vpp != p.vpp:
        if pp * vpp not in layouts:
            st = recipe.curriculum.stages[0]
            layouts[pp * vpp] = propose_layout(unit_costs(m, st.seq_len, st.phase,
                                                          recipe.attention.indexer_loss_coeff > 0),
                                               pp * vpp, m.moe.n_hash_layers)
        layout = layouts[pp * vpp]
        if layout is None:
            return None
        edits["parallel.pp_layout"] = layout
    if pp > 1 and recipe.precision.keep_fp32_params:
        edits["precision.keep_fp32_params"] = False
    if p.micro_batch_size > 1:  # context parallelism splits one row per micro-batch (V4-CP-MICRO-BATCH)
        edits["parallel.micro_batch_size"] = 1
    edits = graph_compatible(recipe, edits)
    stages = recipe.curriculum.stages
    options = {i: [cp for cp in divisors(shard) if cp_ok(recipe, i, cp, shard)] for i in range(len(stages))}
    for i in sorted(options, key=lambda j: -stages[j].seq_len):  # the longest first: a shape that cannot fit fails fast
        if not options[i] or not stage_fits(recipe, i, {**edits, f"curriculum.stages.{i}.cp": options[i][-1]}):
            return None  # the most CP does not fit: none does
    # the most CP leaves the fewest data-parallel ranks, the easiest batches: if the contract fails there, give up
    if _with_batches(recipe, edits, [options[i][-1] for i in range(len(stages))], contract) is None:
        return None
    cps = [_smallest_fitting_cp(recipe, i, edits, options[i]) for i in range(len(stages))]
    edits = _with_batches(recipe, edits, cps, contract)
    if edits is None:
        return None
    edited = with_edits(recipe, edits)  # passed the contract's other rules in _with_batches
    try:
        plans = [memory_plan(edited, i) for i in range(len(recipe.curriculum.stages))]
    except (PlanUnavailable, ValueError, ZeroDivisionError):
        return None
    if not all(plan.fits for plan in plans):
        return None
    return Proposal(changed_edits(recipe, edits), max(plans, key=lambda plan: plan.total_bytes))


def _with_batches(recipe: Recipe, edits: dict[str, Any], cps: list[int], contract: Contract) -> dict[str, Any] | None:
    """``edits`` with each stage's cp, and the global batches doubled (up to ``MAX_NODE_SCALE`` times) until every
    stage splits its batch over dp = shard / cp into enough micro-batches; None when no such batch passes the
    contract's other rules."""
    edits = {**edits, **{f"curriculum.stages.{i}.cp": cp for i, cp in enumerate(cps)}}
    k = 1
    while k <= MAX_NODE_SCALE:
        if k > 1:
            edits["parallel.global_batch_size"] = recipe.parallel.global_batch_size * k
            for i, st in enumerate(recipe.curriculum.stages):
                if st.global_batch_size is not None:
                    edits[f"curriculum.stages.{i}.global_batch_size"] = st.global_batch_size * k
        failed = contract(with_edits(recipe, edits))
        if not failed:
            return edits
        if not set(failed) <= {"V4-BATCH", "V4-PP-MICROBATCHES"}:
            return None  # a rule that a larger batch does not fix
        k *= 2
    return None


def _smallest_fitting_cp(recipe: Recipe, index: int, edits: dict[str, Any], options: list[int]) -> int:
    """The smallest of ``options`` (increasing; the last one fits) under which stage ``index`` fits, by
    bisection: the plan shrinks as cp grows (fewer rows per rank); the caller checks every stage's plan again."""
    lo, hi = 0, len(options) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if stage_fits(recipe, index, {**edits, f"curriculum.stages.{index}.cp": options[mid]}):
            hi = mid
        else:
            lo = mid + 1
    return options[lo]


def forcing_stage(recipe: Recipe) -> tuple[str, float, int, float] | None:
    """The stage that keeps the recipe off its own nodes: (name, GiB per GPU, pp, host GiB per node) of the stage
    that needs the most GPU memory under every lever there (bf16 storage with offload, whole-layer recompute,
    FSDP, the largest ep, the stage's largest cp), at the pipeline size where that stage needs the least, and the
    host memory a node needs for it (``memory_plan.host_bytes_per_node``: when the GPU figure fits, host memory
    is the limit); None when the plan cannot say (a layout or stage it cannot plan). What `V4-MEMORY` names when
    nothing fits on the recipe's nodes."""
    hit = _FORCING_CACHE.get(id(recipe))
    if hit is not None and hit[0] is recipe:  # every failing stage of one validate run names the same stage
        return hit[1]
    if len(_FORCING_CACHE) > 8:
        _FORCING_CACHE.clear()
    found = _forcing_stage(recipe)
    _FORCING_CACHE[id(recipe)] = (recipe, found)
    return found


_FORCING_CACHE: dict[int, tuple[Recipe, "tuple[str, float, int, float] | None"]] = {}


def _forcing_stage(recipe: Recipe) -> tuple[str, float, int, float] | None:
    p, c, m = recipe.parallel, recipe.cluster, recipe.model
    best: tuple[str, float, int, float] | None = None
    for pp in _pp_candidates(recipe, c.nodes):
        shard = c.nodes * c.gpus_per_node // (p.tp * pp)
        edits: dict[str, Any] = {"parallel.pp": pp, "parallel.ep": max(divisors(gcd(m.moe.n_routed_experts, shard))),
                                 "parallel.distributed_optimizer": True, **FULL_RECOMPUTE, **BF16_STORAGE, **OFFLOAD,
                                 "parallel.micro_batch_size": 1}
        if pp * (p.vpp if pp > 1 else 1) == 1:
            edits.update({"parallel.vpp": 1, "parallel.pp_layout": None})
        elif pp != p.pp:
            continue  # another pipeline size needs a layout of its own: the recipe's pp and pp 1 are enough to name it
        worst = None
        for i, st in enumerate(recipe.curriculum.stages):
            cps = [cp for cp in divisors(shard) if cp_ok(recipe, i, cp, shard)]
            try:
                plan = memory_plan(with_edits(recipe, {**edits, f"curriculum.stages.{i}.cp": cps[-1]}), i)
            except (PlanUnavailable, ValueError, ZeroDivisionError, IndexError):
                return None
            if worst is None or plan.total_bytes / 2**30 > worst[1]:
                worst = (st.name, plan.total_bytes / 2**30, pp, host_bytes_per_node(recipe, plan) / 2**30)
        if worst is not None and (best is None or worst[1] < best[1]):
            best = worst
    return best
