"""Pipeline-layout rules: grammar, structure, hash-routed layers with E, and per-stage cost balance."""

from __future__ import annotations

from ..cost_model import PP_BALANCE_THRESHOLD, balance_ratio, propose_layout, stage_costs, unit_costs
from ..layout import LayoutSyntaxError, format_layout, parse_layout
from ..memory_fixes import shell_word
from .base import RULES, Context, rule


@rule("V4-PP-LAYOUT-SYNTAX", fields=("parallel.pp_layout",), scope="recipe",
      fix="write the layout with E t m L, '|' between stages, x*n and (…)*n repeats, e.g. Et*10|t*12|t*12|t*9mL")
def check_layout_syntax(ctx: Context):
    """parallel.pp_layout follows the layout grammar (E t m L, '|', x*n, (…)*n; commas ignored).

    Source: Megatron transformer/pipeline_parallel_layer_layout.py (parse_str_to_list).
    """
    text = ctx.parallel.pp_layout
    if text is None:
        return ctx.na("no pp_layout")
    try:
        parse_layout(text)
    except LayoutSyntaxError as err:
        return ctx.finding("parallel.pp_layout", text, str(err))
    return ctx.ok("parallel.pp_layout", text)


@rule("V4-PP-LAYOUT", fields=("parallel.pp_layout", "parallel.pp", "parallel.vpp", "model.n_layers", "model.mtp.depth"),
      scope="recipe",
      fix="one E first, one L last, n_layers 't', mtp.depth 'm' after every t on the last virtual stage of a rank other than 0, pp·vpp stages")
def check_layout_structure(ctx: Context):
    """The layout has pp·vpp stages, E first, L last, one t per decoder layer and the MTP layers where Megatron needs them.

    Source: Megatron pipeline_parallel_layer_layout.py (validate_layer_layout) and arguments.py:968-981.
    """
    p = ctx.parallel
    if p.pp_layout is None:
        if p.pp * p.vpp > 1:
            return ctx.finding("parallel.pp_layout", None, f"pp·vpp = {p.pp * p.vpp} stages need an explicit layout",
                               _proposed_layout_fix(ctx))
        return ctx.na("single stage, no layout")
    if p.pp * p.vpp == 1:
        return ctx.finding("parallel.pp_layout", p.pp_layout,
                           "pp·vpp = 1: the job runs the whole model as one stage and never reads a layout",
                           "set parallel.pp_layout=null (a layout takes effect with parallel.pp > 1)")
    if ctx.layout is None:
        return ctx.na("layout does not parse (V4-PP-LAYOUT-SYNTAX)")
    fix = _proposed_layout_fix(ctx) if ctx.layout_problems else None
    found = [ctx.finding("parallel.pp_layout", p.pp_layout, problem, fix) for problem in ctx.layout_problems]
    return found or ctx.ok("parallel.pp_layout", p.pp_layout, f"{len(ctx.layout.stages)} stages")


def _proposed_layout_fix(ctx: Context) -> str | None:
    """'set parallel.pp_layout=…': pp·vpp stages balanced by the cost model at the curriculum's longest
    seq_len (E and the hash-routed layers first, the MTP layers and L last); None (the rule's general fix)
    when the model is too large for the search or has fewer decoder layers than stages."""
    p, m = ctx.parallel, ctx.model
    n_stages = p.pp * p.vpp
    if p.pp == 1 and p.vpp > 1:  # V4-PP-VPP refuses vpp without pp: the same fix, not a layout for vpp stages
        return RULES["V4-PP-VPP"].fix
    if n_stages < 2 or m.n_layers < n_stages - 1:
        return None
    longest = max(ctx.recipe.curriculum.stages, key=lambda st: st.seq_len)
    units = unit_costs(m, longest.seq_len, longest.phase, ctx.recipe.attention.indexer_loss_coeff > 0)
    best = propose_layout(units, n_stages, m.moe.n_hash_layers)
    if best is None:
        return None
    return (f"set {shell_word(f'parallel.pp_layout={best}')} ({n_stages} stages, balanced by the cost model at "
            f"seq_len {longest.seq_len})")


@rule("V4-PP-MTP-WITH-LOSS", fields=("parallel.pp_layout", "model.mtp.depth"), scope="recipe",
      fix="put every 'm' in the last virtual stage, right before 'L' (e.g. …|t*9mL)")
def check_mtp_with_loss(ctx: Context):
    """The MTP layers 'm' share the last virtual stage with the loss 'L'.

    The bundled job runs the MTP layers beside the head they share with the main model and reads the
    main model's final mHC streams there (docs/parallelism.md "Pipeline parallel").
    Source: released inference/model.py (MTPBlock reuses embed and head); docs/parallelism.md.
    """
    if ctx.model.mtp.depth == 0 or ctx.layout is None:
        return ctx.na("no MTP layers" if ctx.model.mtp.depth == 0 else "no parsed layout")
    last = len(ctx.layout.stages) - 1
    holders = sorted({i for i, stage in enumerate(ctx.layout.stages) if "m" in stage})
    if holders != [last] or "L" not in ctx.layout.stages[last]:
        return ctx.finding("parallel.pp_layout", ctx.parallel.pp_layout,
                           f"MTP layers sit in virtual stage(s) {holders}, the loss L in stage "
                           f"{[i for i, s in enumerate(ctx.layout.stages) if 'L' in s]}; the job needs them together in the last",
                           _mtp_moved_fix(ctx))
    return ctx.ok("parallel.pp_layout", ctx.parallel.pp_layout)


@rule("V4-PP-HASH-FIRST", fields=("parallel.pp_layout", "model.moe.n_hash_layers"), scope="recipe",
      fix="set parallel.pp_layout to a layout whose first stage holds E and all hash-routed layers")
def check_hash_first(ctx: Context):
    """Hash-routed MoE layers sit on the first pipeline stage, together with the embedding E.

    Source: Megatron-Bridge models/deepseek/deepseek_v4_bridge.py:125 (tid2eid needs the token ids); v4-model-spec §3.
    """
    n_hash = ctx.model.moe.n_hash_layers
    if n_hash == 0 or ctx.layout is None:
        return ctx.na("no hash-routed layers" if n_hash == 0 else "no parsed layout")
    first = ctx.layout.stages[0]
    if "E" not in first or first.count("t") < n_hash:
        return ctx.finding("parallel.pp_layout", ctx.parallel.pp_layout,
                           f"first stage holds {first.count('t')} decoder layers{'' if 'E' in first else ' and no E'}, "
                           f"but model.moe.n_hash_layers = {n_hash}", _proposed_layout_fix(ctx))
    return ctx.ok("parallel.pp_layout", ctx.parallel.pp_layout)


@rule("V4-PP-BALANCE", fields=("parallel.pp_layout", "curriculum.stages.*.seq_len", "curriculum.stages.*.phase"),
      fix="use the proposed layout (cost model: docs/validate.md)")
def check_balance(ctx: Context):
    """The costliest pipeline stage stays within PP_BALANCE_THRESHOLD (1.25) × the mean stage cost at this stage's seq_len.

    Source: seed 000 §11.3 (equal layer counts are not balanced stages); seed 004 item 12 (4-node rebalance).
    """
    lay = ctx.layout
    if lay is None or ctx.layout_problems or len(lay.stages) < 2:
        return ctx.na("needs a valid layout with ≥ 2 stages")
    loss_on = ctx.recipe.attention.indexer_loss_coeff > 0
    units = unit_costs(ctx.model, ctx.seq_len, ctx.stage.phase, loss_on)
    ratio = balance_ratio(stage_costs(lay, units))
    if ratio > PP_BALANCE_THRESHOLD:
        best = propose_layout(units, len(lay.stages), ctx.model.moe.n_hash_layers)
        fix = None
        if best is not None:
            fix = f"set {shell_word(f'parallel.pp_layout={best}')} (max/mean {balance_ratio(stage_costs(parse_layout(best), units)):.3f} by the cost model)"
        return ctx.finding("parallel.pp_layout", ctx.parallel.pp_layout,
                           f"max/mean stage cost {ratio:.3f} > {PP_BALANCE_THRESHOLD} at seq_len {ctx.seq_len} ({ctx.stage.phase})", fix)
    return ctx.ok("parallel.pp_layout", ctx.parallel.pp_layout, f"max/mean {ratio:.3f}")


def _mtp_moved_fix(ctx: Context) -> str | None:
    """'set parallel.pp_layout=…' with every 'm' taken out and mtp.depth of them put right before the last
    stage's 'L'; None (the rule's general fix) where that would leave a stage empty or L is elsewhere (the stage
    boundaries must move then, which V4-PP-BALANCE's proposal does once the structure is valid)."""
    moved = [[u for u in stage if u != "m"] for stage in ctx.layout.stages]
    if "L" not in moved[-1] or not all(moved):
        return None
    at = moved[-1].index("L")
    moved[-1][at:at] = ["m"] * ctx.model.mtp.depth
    return f"set {shell_word(f'parallel.pp_layout={format_layout(moved)}')}"
