"""Settings that make an over-budget curriculum stage fit: the fixes V4-MEMORY proposes (pure Python).

Each proposal is a set of recipe edits (dotted key → value, the same keys a dotlist override takes) and
the memory plan of the stage with them. Tried in order, each on its own, the smallest step that fits:

1. more context parallelism for the stage (``curriculum.stages.N.cp``): fewer rows per rank;
2. more expert parallelism (``parallel.ep``): fewer routed experts per rank;
3. the distributed optimizer (``parallel.distributed_optimizer=true``): dense state sharded over dp·cp;
4. more pipeline ranks (``parallel.pp`` with a balanced ``parallel.pp_layout``): fewer layers per rank;
5. selective recompute (``parallel.recompute_modules``) of every region without collectives, then
   whole-layer recompute (``parallel.recompute_granularity=full``);
6. all of the above together (whole-layer recompute included); then the same on 2, 4, … 64 times the nodes (``cluster.nodes``).

Every proposal keeps the other rules satisfied where they depend on the same sizes (cp divides the pipeline
rank's ranks and the sequence into slices of at least the boundary width, ep divides the experts and
dp·cp, enough micro-batches for the pipeline schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any

from . import derived
from .cost_model import propose_layout, unit_costs
from .memory_plan import MemoryPlan, PlanUnavailable, memory_plan
from .recompute_policy import SELECTIVE_ALL
from .schema.recipe import Recipe

FULL_RECOMPUTE = {"parallel.recompute_granularity": "full", "parallel.recompute_modules": []}
"""Whole-layer recompute: each layer keeps only its input streams (``recompute_policy``)."""

MAX_NODE_SCALE = 64
"""Largest multiple of the recipe's nodes a proposal considers."""


@dataclass(frozen=True)
class Proposal:
    """Recipe edits (dotted key → value) and the stage's plan with them."""

    edits: dict[str, Any]
    plan: MemoryPlan

    def text(self) -> str:
        """``k=v k2=v2 (plan 98.2 GiB)``."""
        parts = " ".join(f"{k}={_yaml(v)}" for k, v in self.edits.items())
        return f"{parts} ({self.plan.total_bytes / 2**30:.1f} GiB)"


def _yaml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(map(str, v)) + "]"
    return str(v)


def with_edits(recipe: Recipe, edits: dict[str, Any]) -> Recipe:
    """A copy of ``recipe`` with ``edits`` applied (keys under parallel., cluster., precision. and
    curriculum.stages.N.). Not validated: the plan only reads sizes."""
    sections: dict[str, dict[str, Any]] = {}
    stages = list(recipe.curriculum.stages)
    for key, value in edits.items():
        head, _, rest = key.partition(".")
        if head == "curriculum":
            _, index, attr = rest.split(".")
            stages[int(index)] = stages[int(index)].model_copy(update={attr: value})
        else:
            sections.setdefault(head, {})[rest] = tuple(value) if isinstance(value, list) else value
    update: dict[str, Any] = {name: getattr(recipe, name).model_copy(update=vals) for name, vals in sections.items()}
    update["curriculum"] = recipe.curriculum.model_copy(update={"stages": tuple(stages)})
    return recipe.model_copy(update=update)


def _plan(recipe: Recipe, index: int, edits: dict[str, Any]) -> MemoryPlan | None:
    try:
        return memory_plan(with_edits(recipe, edits), index)
    except (PlanUnavailable, ValueError, ZeroDivisionError):
        return None


def _cp_ok(recipe: Recipe, index: int, cp: int, shard: int) -> bool:
    st, m = recipe.curriculum.stages[index], recipe.model
    rows = st.seq_len * recipe.parallel.micro_batch_size
    return (shard % cp == 0 and rows % cp == 0 and st.seq_len % cp == 0
            and rows // cp >= derived.boundary_width(m.window_size, m.compress_ratios))


def _batches_ok(recipe: Recipe, pp: int, shard: int, cps: list[int]) -> bool:
    """Every stage splits its global batch over dp = shard / cp and runs at least pp micro-batches."""
    micro = recipe.parallel.micro_batch_size
    for st, cp in zip(recipe.curriculum.stages, cps):
        dp = shard // cp
        if dp < 1 or shard % cp:  # a stage whose cp does not divide the ranks (V4-CP-DIVISIBLE reports it)
            return False
        gbs = recipe.stage_global_batch(st)
        if gbs % (micro * dp) or (pp > 1 and gbs // (micro * dp) < pp):
            return False
    return True


def _single_changes(recipe: Recipe, index: int, nodes: int) -> list[dict[str, Any]]:
    """Candidate edits on ``nodes`` nodes (the recipe's own or more), smallest step first."""
    p, c, m = recipe.parallel, recipe.cluster, recipe.model
    world = nodes * c.gpus_per_node
    shard = world // (p.tp * p.pp)
    base: dict[str, Any] = {} if nodes == c.nodes else {"cluster.nodes": nodes}
    st = recipe.curriculum.stages[index]
    cp_now = recipe.stage_cp(st)
    out = []
    for cp in range(cp_now + 1, shard + 1):
        if _cp_ok(recipe, index, cp, shard):
            out.append({**base, f"curriculum.stages.{index}.cp": cp})
    for ep in range(p.ep + 1, gcd(m.moe.n_routed_experts, shard) + 1):
        if m.moe.n_routed_experts % ep == 0 and shard % ep == 0:
            out.append({**base, "parallel.ep": ep})
    if not p.distributed_optimizer:
        extra = {"precision.keep_fp32_params": False} if p.pp > 1 and recipe.precision.keep_fp32_params else {}
        out.append({**base, "parallel.distributed_optimizer": True, **extra})
    out += _pp_changes(recipe, index, world, base)
    return out


def _pp_changes(recipe: Recipe, index: int, world: int, base: dict[str, Any]) -> list[dict[str, Any]]:
    p, m = recipe.parallel, recipe.model
    st = recipe.curriculum.stages[index]
    cps = [recipe.stage_cp(s) for s in recipe.curriculum.stages]
    out = []
    pp = p.pp * 2
    while pp <= world and pp * p.vpp <= m.n_layers:
        shard = world // (p.tp * pp)
        if world % (p.tp * pp) == 0 and all(shard % cp == 0 for cp in cps) and shard % p.ep == 0 \
                and _batches_ok(recipe, pp, shard, cps):
            units = unit_costs(m, st.seq_len, st.phase, recipe.attention.indexer_loss_coeff > 0)
            layout = propose_layout(units, pp * p.vpp, m.moe.n_hash_layers)
            if layout is not None:
                out.append({**base, "parallel.pp": pp, "parallel.pp_layout": layout})
        pp *= 2
    return out


def _combined(recipe: Recipe, index: int, nodes: int) -> dict[str, Any] | None:
    """The largest cp for the stage, the largest ep and the distributed optimizer together; on more nodes
    the global batches grow with the node count where a stage's dp would no longer divide them."""
    changes = _single_changes(recipe, index, nodes)
    merged: dict[str, Any] = {} if nodes == recipe.cluster.nodes else {"cluster.nodes": nodes}
    if recipe.parallel.recompute_granularity != "full":
        merged.update(FULL_RECOMPUTE)
    for edits in changes:  # later (larger) values of the same key win: cp and ep are tried in increasing order
        if "parallel.pp" not in edits:
            merged.update(edits)
    if nodes != recipe.cluster.nodes:
        p = recipe.parallel
        shard = nodes * recipe.cluster.gpus_per_node // (p.tp * p.pp)
        cps = [merged.get(f"curriculum.stages.{i}.cp", recipe.stage_cp(st)) for i, st in enumerate(recipe.curriculum.stages)]
        if not _batches_ok(recipe, p.pp, shard, cps):
            k = nodes // recipe.cluster.nodes
            merged["parallel.global_batch_size"] = p.global_batch_size * k
            for i, st in enumerate(recipe.curriculum.stages):
                if st.global_batch_size is not None:
                    merged[f"curriculum.stages.{i}.global_batch_size"] = st.global_batch_size * k
            if not _batches_ok(with_edits(recipe, merged), p.pp, shard, cps):
                return None
    return merged or None


def fit_proposals(recipe: Recipe, index: int, limit: int = 3) -> tuple[list[Proposal], Proposal | None]:
    """Up to ``limit`` edits that make stage ``index`` fit on the recipe's nodes (smallest first), and,
    when none does, the smallest node count (with the combined settings) that fits, else None."""
    found: list[Proposal] = []
    seen: set[str] = set()
    for edits in _single_changes(recipe, index, recipe.cluster.nodes) + _recompute_changes(recipe):
        key = next(iter(k for k in edits if k != "precision.keep_fp32_params"))
        if key in seen:
            continue
        plan = _plan(recipe, index, edits)
        if plan is not None and plan.fits:
            found.append(Proposal(edits, plan))
            seen.add(key)
        if len(found) >= limit:
            return found, None
    if found:
        return found, None
    combined = _combined(recipe, index, recipe.cluster.nodes)
    if combined:
        plan = _plan(recipe, index, combined)
        if plan is not None and plan.fits:
            return [Proposal(combined, plan)], None
    scale = 2
    while scale <= MAX_NODE_SCALE:
        combined = _combined(recipe, index, recipe.cluster.nodes * scale)
        plan = _plan(recipe, index, combined) if combined else None
        if plan is not None and plan.fits:
            return [], Proposal(combined, plan)
        scale *= 2
    return [], None


def _recompute_changes(recipe: Recipe) -> list[dict[str, Any]]:
    """Selective recompute of every region without collectives, then whole-layer recompute (``full``)."""
    p = recipe.parallel
    if p.recompute_granularity == "full":
        return []
    out = [] if set(SELECTIVE_ALL) <= set(p.recompute_modules) else [
        {"parallel.recompute_granularity": "selective", "parallel.recompute_modules": list(SELECTIVE_ALL)}]
    return out + [FULL_RECOMPUTE]
