"""Which layers each pipeline rank holds, and how many micro-batch forwards it keeps for backward (pure Python).

Read by the memory plan (``memory_plan.py``): the virtual stages of ``parallel.pp_layout`` (E = embedding,
t = decoder layer, m = MTP layer, L = norm, head, hc_head; ``model/parallel/pipeline.py`` cuts the model the
same way) and the forwards in flight at a rank's first backward under torch's 1F1B and interleaved 1F1B
schedules (``torch.distributed.pipelining.schedules``; tests/validators/test_memory_plan.py checks the
counts against torch's own warm-up formula).
"""

from __future__ import annotations

from .layout import LayoutSyntaxError, parse_layout, structure_problems
from .schema.recipe import Recipe


class PlanUnavailable(ValueError):
    """The recipe gives no plan (an unparseable or invalid layout, DP undefined); another rule reports why."""


def virtual_stages(recipe: Recipe) -> list[tuple[str, ...]]:
    """Symbols of each virtual stage (one stage with everything when pp · vpp = 1, as the job runs it, whatever
    ``parallel.pp_layout`` says: V4-PP-LAYOUT refuses a layout there).

    Raises: PlanUnavailable for a layout that does not parse or does not fit the model (V4-PP-LAYOUT*)."""
    p, m = recipe.parallel, recipe.model
    if p.pp * p.vpp == 1:
        return [("E",) + ("t",) * m.n_layers + ("m",) * m.mtp.depth + ("L",)]
    if p.pp_layout is None:
        raise PlanUnavailable("parallel.pp_layout is required when pp·vpp > 1 (V4-PP-LAYOUT)")
    try:
        layout = parse_layout(p.pp_layout)
    except LayoutSyntaxError as exc:
        raise PlanUnavailable(f"parallel.pp_layout does not parse ({exc})") from None
    if structure_problems(layout, p.pp, p.vpp, m.n_layers, m.mtp.depth):
        raise PlanUnavailable("parallel.pp_layout does not fit the model (V4-PP-LAYOUT)")
    return list(layout.stages)


def in_flight_ops(pp: int, vpp: int, rank: int, accum: int) -> list[int]:
    """Local virtual-stage index of every forward this rank holds for backward at its first backward.

    pp = 1: one micro-batch. vpp = 1 (Schedule1F1B): min(pp - rank, accum). vpp > 1
    (ScheduleInterleaved1F1B, torch.distributed.pipelining.schedules ``_get_warmup_ops``): the warm-up
    forwards plus one, in rounds of ``accum // max(1, accum // pp)`` micro-batches per local stage.
    """
    if pp == 1:
        return [0] * vpp
    if vpp == 1:
        return [0] * max(1, min(pp - rank, accum))
    per_round = accum // max(1, accum // pp)
    warmup = min((vpp - 1) * per_round + 2 * (pp - 1 - rank), accum * vpp)
    return [(j // per_round) % vpp for j in range(min(warmup + 1, accum * vpp))]


def stage_layers(stages: list[tuple[str, ...]], n_layers: int) -> list[list[int]]:
    """Decoder and MTP layer ids of each virtual stage (MTP layer k is n_layers + k)."""
    out, t, k = [], 0, 0
    for symbols in stages:
        ids = []
        for s in symbols:
            if s == "t":
                ids.append(t)
                t += 1
            elif s == "m":
                ids.append(n_layers + k)
                k += 1
        out.append(ids)
    return out
