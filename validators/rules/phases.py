"""Attention-phase rules: dense → sparse warm-up → sparse, and what each phase builds and trains."""

from __future__ import annotations

from ..schema.curriculum import DEFAULT_INDEXER_LOSS, PHASE_ORDER
from .base import Context, rule


@rule("V4-PHASE-INDEXER-LOSS", fields=("curriculum.stages.*.phase", "attention.indexer_loss_coeff"),
      fix="set attention.indexer_loss_coeff=1e-2 (the released recipes' value; any value > 0 trains the indexer)")
def check_indexer_trains(ctx: Context):
    """Warm-up and sparse stages need indexer_loss_coeff > 0, otherwise the indexer never trains.

    Source: seed 004 item 5 (topk has no gradient; without the KL loss the indexer is frozen); seed 000 §2-§3.
    """
    if ctx.stage.phase == "dense" or 4 not in ctx.all_ratios:
        return ctx.na("dense phase or no CSA layer: no indexer")
    coeff = ctx.recipe.attention.indexer_loss_coeff
    if coeff <= 0:
        return ctx.finding("attention.indexer_loss_coeff", coeff, f"{ctx.stage.phase} stage '{ctx.stage.name}' with indexer_loss_coeff={coeff}")
    return ctx.ok("attention.indexer_loss_coeff", coeff)


@rule("V4-PHASE-DENSE-NO-INDEXER", fields=("curriculum.stages.*.phase", "curriculum.stages.*.indexer_loss"),
      fix="set the stage's indexer_loss to null (dense mode builds no indexer)")
def check_dense_no_indexer(ctx: Context):
    """Dense mode builds no indexer, so a dense stage cannot choose an indexer-loss target.

    Source: Megatron csa_dense_mode (transformer_config.py; PR #4458); seed 000 §2.
    """
    s = ctx.stage
    if s.phase != "dense":
        return ctx.na(f"phase={s.phase}")
    if s.indexer_loss is not None:
        return ctx.finding(ctx.stage_path("indexer_loss"), s.indexer_loss, "dense stage sets an indexer-loss target, but dense mode has no indexer",
                           f"set {ctx.stage_path('indexer_loss')}=null (dense mode builds no indexer)")
    return ctx.ok(ctx.stage_path("phase"), s.phase)


@rule("V4-PHASE-INDEXER-TARGET", fields=("curriculum.stages.*.phase", "curriculum.stages.*.indexer_loss"),
      fix="remove the stage's indexer_loss: the phase sets the KL target (warmup: dense, sparse: sparse)")
def check_indexer_target(ctx: Context):
    """A warmup or sparse stage trains its phase's KL target (warmup: dense, sparse: sparse); the job runs no other.

    Source: v4launch/training/plan.py (plan_curriculum refuses any other indexer_loss); seed 000 §2.
    """
    s = ctx.stage
    if s.phase == "dense" or s.indexer_loss is None:
        return ctx.na("dense phase" if s.phase == "dense" else "indexer_loss follows the phase")
    tied = DEFAULT_INDEXER_LOSS[s.phase]
    if s.indexer_loss != tied:
        return ctx.finding(ctx.stage_path("indexer_loss"), s.indexer_loss,
                           f"{s.phase} stage '{s.name}' asks for the {s.indexer_loss} KL target; the bundled model "
                           f"ties it to the phase ({s.phase}: {tied})",
                           f"set {ctx.stage_path('indexer_loss')}=null (the phase sets the KL target)")
    return ctx.ok(ctx.stage_path("indexer_loss"), s.indexer_loss)


@rule("V4-PHASE-ORDER", fields=("curriculum.stages.*.phase",),
      fix="order the stages dense → warmup → sparse; start a new run to go back to dense")
def check_phase_order(ctx: Context):
    """Curriculum phases only move forward: dense → warmup → sparse.

    Source: DeepSeek-V4 report (dense attention first, sparse with a short indexer warm-up); seed 000 §2.
    """
    if ctx.prev is None:
        return ctx.na("first stage")
    before, now = ctx.prev.phase, ctx.stage.phase
    if PHASE_ORDER[now] < PHASE_ORDER[before]:
        return ctx.finding(ctx.stage_path("phase"), now, f"stage '{ctx.stage.name}' goes back from {before} to {now}")
    return ctx.ok(ctx.stage_path("phase"), now, f"after {before}")


@rule("V4-PHASE-SKIP-WARMUP", fields=("curriculum.stages.*.phase",), severity="warning",
      fix="insert a short warmup stage between the dense and sparse stages")
def check_skip_warmup(ctx: Context):
    """Going from dense straight to sparse skips the indexer warm-up: sparse top-k starts from an untrained indexer.

    Source: DeepSeek-V4 report (sparse attention with a short indexer warm-up); seed 000 §2.
    """
    if ctx.prev is None:
        return ctx.na("first stage")
    if ctx.prev.phase == "dense" and ctx.stage.phase == "sparse":
        return ctx.finding(ctx.stage_path("phase"), "sparse", f"stage '{ctx.stage.name}' follows dense stage '{ctx.prev.name}' without warmup")
    return ctx.ok(ctx.stage_path("phase"), ctx.stage.phase)
