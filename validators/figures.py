"""Derived figures of one curriculum stage, as shown in the report (numbers from ``derived`` and ``cost_model``)."""

from __future__ import annotations

from typing import Any

from . import derived
from .cost_model import PP_BALANCE_THRESHOLD, balance_ratio, propose_layout, stage_costs, unit_costs
from .layout import LayoutSyntaxError, parse_layout, structure_problems
from .memory_plan import PlanUnavailable, memory_plan
from .schema.curriculum import Stage
from .schema.recipe import Recipe


def _pipeline(recipe: Recipe, stage: Stage) -> dict[str, Any]:
    """PP stage costs (GFLOP per token, forward) of the configured layout; a balanced proposal when it is off balance."""
    p, m = recipe.parallel, recipe.model
    out: dict[str, Any] = {"pp_stage_gflop_per_token": None, "pp_balance": None, "pp_proposed_layout": None}
    if p.pp_layout is None:
        return out
    try:
        layout = parse_layout(p.pp_layout)
    except LayoutSyntaxError:
        return out
    if structure_problems(layout, p.pp, p.vpp, m.n_layers, m.mtp.depth):
        return out
    units = unit_costs(m, stage.seq_len, stage.phase, recipe.attention.indexer_loss_coeff > 0)
    costs = stage_costs(layout, units)
    out["pp_stage_gflop_per_token"] = [round(c / 1e9, 3) for c in costs]
    out["pp_balance"] = round(balance_ratio(costs), 3)
    if len(costs) > 1 and out["pp_balance"] > PP_BALANCE_THRESHOLD:
        out["pp_proposed_layout"] = propose_layout(units, len(costs), m.moe.n_hash_layers)
    return out


def _memory(recipe: Recipe, stage: Stage) -> dict[str, Any] | None:
    """The stage's memory plan (``memory_plan.MemoryPlan.to_dict``), None when no plan can be made."""
    index = next(i for i, s in enumerate(recipe.curriculum.stages) if s is stage)
    try:
        return memory_plan(recipe, index).to_dict()
    except PlanUnavailable:
        return None


def stage_figures(recipe: Recipe, stage: Stage) -> dict[str, Any]:
    """Local rows, boundary width, compressed all-gather bytes, top-k padding, PP costs and the memory plan of ``stage``.

    All-gather bytes are the gathered compressed state each CP rank holds per layer (0 at CP=1:
    there is no all-gather); dense stages gather no indexer keys.
    """
    m, cp = recipe.model, recipe.stage_cp(stage)
    ratios = list(m.compress_ratios)
    indexer = stage.phase != "dense"
    gathered = cp > 1
    csa = derived.csa_allgather_bytes(stage.seq_len, kv_dim=m.head_dim, index_dim=m.indexer.head_dim, with_indexer=indexer)
    hca = derived.hca_allgather_bytes(stage.seq_len, kv_dim=m.head_dim)
    total = derived.allgather_bytes_total(stage.seq_len, ratios, kv_dim=m.head_dim, index_dim=m.indexer.head_dim,
                                          with_indexer=indexer)
    sm = recipe.cluster.sm
    dp = recipe.stage_dp(stage)
    return {
        "seq_len": stage.seq_len,
        "cp": cp,
        "dp": dp,
        "tokens_per_step": recipe.stage_global_batch(stage) * stage.seq_len,
        "local_rows": derived.local_rows(stage.seq_len, cp),
        "boundary_width": derived.boundary_width(m.window_size, ratios),
        "csa_layers": ratios.count(derived.CSA_RATIO),
        "hca_layers": ratios.count(derived.HCA_RATIO),
        "csa_allgather_bytes_per_layer": csa if gathered else 0,
        "hca_allgather_bytes_per_layer": hca if gathered else 0,
        "allgather_bytes_total": total if gathered else 0,
        "topk_alignment": derived.topk_alignment(sm),
        "topk_padding_waste": derived.topk_padding_waste(m.indexer.topk, sm) if indexer and derived.CSA_RATIO in ratios else 0,
        **_pipeline(recipe, stage),
        "memory": _memory(recipe, stage),
    }
