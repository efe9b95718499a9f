"""The curriculum as the job executes it: per-stage step budgets, batch geometry and the LR schedule.

Global step ``s`` counts optimizer steps since the start of the run (all stages); stage ``i``
owns steps ``[first_step_i, first_step_i + steps_i)``. The LR schedule runs over the whole
curriculum: linear warm-up over ``optimizer.warmup_steps``, then cosine / constant / wsd decay
towards ``optimizer.min_lr``; each stage scales it by its own peak (``stage.lr`` or
``optimizer.lr``). Muon groups use the same shape with peak ``muon_lr · stage_peak / lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ContractViolation
from ..validators.schema.curriculum import DEFAULT_INDEXER_LOSS


@dataclass(frozen=True)
class StagePlan:
    """One stage, resolved for the run's world: ``dp = world / (pp · cp)`` data-parallel replicas of ``cp``
    ranks on each of the ``pp`` pipeline ranks.

    Attributes:
        index, name, phase, seq_len: from the stage (seq_len in tokens per packed sequence).
        cp: context-parallel size of the stage (``stage.cp`` or ``parallel.cp``).
        dp: data-parallel size of the stage = world / (pp · cp).
        steps: optimizer steps of the stage (``steps``, or ``ceil(tokens / (global_batch·seq_len))``).
        first_step: global step at which the stage starts.
        global_batch: packed sequences per optimizer step (all ranks).
        micro_batch: packed sequences per forward on one rank.
        accum: micro-batches per step on each rank = global_batch / (micro_batch · dp) (under PP: the
            micro-batches of the pipeline schedule).
        peak_lr: this stage's peak AdamW learning rate.
        kernel_backend: attention kernels of the stage (``stage.kernel_backend`` or ``attention.kernel_backend``).
        pp: pipeline-parallel size of the run (``parallel.pp``; the same in every stage).
    """

    index: int
    name: str
    phase: str
    seq_len: int
    cp: int
    dp: int
    steps: int
    first_step: int
    global_batch: int
    micro_batch: int
    accum: int
    peak_lr: float
    kernel_backend: str = "reference"
    pp: int = 1

    @property
    def end_step(self) -> int:
        """Global step after the stage's last step."""
        return self.first_step + self.steps

    @property
    def tokens_per_step(self) -> int:
        """Training tokens per optimizer step (all ranks)."""
        return self.global_batch * self.seq_len


def plan_curriculum(recipe: Any, world: int) -> list[StagePlan]:
    """Resolve every stage of ``recipe`` for a run of ``world`` ranks (tp = 1, dp = world / (pp · cp) per stage).

    Raises:
        ContractViolation: a tp > 1 recipe; a pipeline the job cannot run (:func:`_check_pp`); a stage whose cp
            does not divide the ranks of a pipeline rank, whose packed sequence does not split into cp slices of
            at least the boundary width; a global batch not divisible by micro_batch · dp; a stage whose
            indexer_loss override the bundled model cannot follow; under PP, fewer micro-batches than the
            schedule needs; parallel.ep that does not divide the routed experts or the ranks of a pipeline rank.
    """
    if recipe.parallel.tp != 1:
        raise ContractViolation(f"parallel.tp={recipe.parallel.tp}: the training job runs tp = 1 only",
                                hint="set parallel.tp=1 (V4 hybrid attention has no TP)")
    pp = _check_pp(recipe, world)
    _check_ep(recipe, world, pp)
    recompute_names(recipe)
    plans, step = [], 0
    for i, st in enumerate(recipe.curriculum.stages):
        cp = recipe.stage_cp(st)
        _check_cp(recipe, i, st, cp, world, pp)
        dp = world // (pp * cp)
        if st.phase != "dense" and st.indexer_loss not in (None, DEFAULT_INDEXER_LOSS[st.phase]):
            raise ContractViolation(
                f"curriculum.stages[{i}] '{st.name}': indexer_loss={st.indexer_loss!r} in phase {st.phase!r} — "
                "the bundled model ties the KL target to the phase (warmup: dense, sparse: sparse)",
                hint=f"remove curriculum.stages.{i}.indexer_loss")
        micro = recipe.parallel.micro_batch_size
        gbs = recipe.stage_global_batch(st)
        if gbs % (micro * dp):
            raise ContractViolation(
                f"curriculum.stages[{i}] '{st.name}': global batch {gbs} is not divisible by micro_batch_size "
                f"{micro} x data-parallel size {dp}", hint="choose a global_batch_size that is a multiple of "
                f"{micro * dp}")
        accum = gbs // (micro * dp)
        _check_pipeline_batches(recipe, i, st, accum, micro * dp)
        n = st.steps if st.steps is not None else math.ceil(st.tokens / (gbs * st.seq_len))
        plans.append(StagePlan(index=i, name=st.name, phase=st.phase, seq_len=st.seq_len, cp=cp, dp=dp, steps=n,
                               first_step=step,
                               global_batch=gbs, micro_batch=micro, accum=accum,
                               peak_lr=st.lr if st.lr is not None else recipe.optimizer.lr,
                               kernel_backend=st.kernel_backend or recipe.attention.kernel_backend, pp=pp))
        step += n
    return plans


def recompute_names(recipe: Any) -> list[str]:
    """The regions the job recomputes (``parallel.recompute_*``), with the precision policy checked too.

    Raises:
        ContractViolation: what ``model/parallel/recompute.py`` and ``precision.py`` refuse (the validator's
            V4-RECOMPUTE and V4-PREC-* rules refuse the same settings).
    """
    from ..model.parallel.precision import check_precision_policy
    from ..model.parallel.recompute import modules_from_recipe

    par = recipe.parallel
    try:
        check_precision_policy(recipe.precision)
        return modules_from_recipe(par.recompute_granularity, par.recompute_modules)
    except ValueError as exc:
        message, _, fix = str(exc).partition(" Fix: ")
        raise ContractViolation(message, hint=fix or "check `v4launch validate`") from None


def _check_ep(recipe: Any, world: int, pp: int) -> None:
    """EP folds over the S = world / pp ranks of a pipeline rank (V4-EP-FOLD) and splits the experts evenly."""
    ep, experts = recipe.parallel.ep, recipe.model.moe.n_routed_experts
    if experts % ep:
        raise ContractViolation(f"parallel.ep={ep} does not divide model.moe.n_routed_experts={experts}: each EP "
                                "rank holds n_routed_experts / ep experts",
                                hint=f"choose parallel.ep from the divisors of {experts}")
    shard = world // pp
    if shard % ep:
        raise ContractViolation(f"parallel.ep={ep} does not divide the {shard} ranks of a pipeline rank (world "
                                f"{world} / pp {pp}): EP groups fold over dp x cp (rule V4-EP-FOLD)",
                                hint=f"choose parallel.ep from the divisors of {shard}, or change cluster.nodes / "
                                     "gpus_per_node / parallel.pp")


def _check_pp(recipe: Any, world: int) -> int:
    """The run's pipeline size, refused when the world does not split into it or the layout cannot run."""
    par = recipe.parallel
    pp, vpp = par.pp, par.vpp
    if pp < 1 or world % pp:
        raise ContractViolation(f"parallel.pp={pp} does not divide the world size {world} (cluster.nodes x "
                                "cluster.gpus_per_node)", hint=f"choose a pp that divides {world}")
    if pp * vpp == 1:
        return pp
    if pp == 1:
        raise ContractViolation(f"parallel.vpp={vpp} with parallel.pp=1: virtual stages need pipeline ranks",
                                hint="set parallel.vpp=1, or parallel.pp > 1")
    from ..model.parallel.pipeline import stage_specs

    m = recipe.model
    try:
        stage_specs(par.pp_layout or "", pp, vpp, m.n_layers, m.mtp.depth)
    except ValueError as exc:
        raise ContractViolation(str(exc).split(" Fix:")[0],
                                hint="set parallel.pp_layout to the layout `v4launch validate` proposes") from None
    return pp


def _check_pipeline_batches(recipe: Any, i: int, st: Any, accum: int, per_round: int) -> None:
    """Under PP the schedule's micro-batches (the stage's accum) must fill it: at least pp (1F1B); with
    vpp > 1 (interleaved 1F1B) also divisible by its rounds ``max(1, accum // pp)``."""
    pp, vpp = recipe.parallel.pp, recipe.parallel.vpp
    if pp == 1:
        return
    rounds = max(1, accum // pp)
    if accum < pp or (vpp > 1 and accum % rounds):
        need = f"at least {pp}" + (f", in rounds of equal size (a count divisible by max(1, count // pp) = {rounds})"
                                   if vpp > 1 else "")
        raise ContractViolation(
            f"curriculum.stages[{i}] '{st.name}': {accum} micro-batches per step, but the pipeline schedule over "
            f"pp={pp} ranks needs {need}", hint=f"raise the stage's global batch to a multiple of {per_round * pp}")


def _check_cp(recipe: Any, i: int, st: Any, cp: int, world: int, pp: int = 1) -> None:
    """Refuse a stage's CP size the job cannot run (the validator's V4-CP-* rules, checked again here)."""
    where = f"curriculum.stages[{i}] '{st.name}'"
    ranks = world // pp
    if cp < 1 or ranks % cp:
        size = f"the world size {world} (cluster.nodes x cluster.gpus_per_node)" if pp == 1 else \
            f"the {ranks} ranks of a pipeline rank (world {world} / parallel.pp {pp})"
        raise ContractViolation(
            f"{where}: cp={cp} does not divide {size}",
            hint=f"choose a cp that divides {ranks} (curriculum.stages.{i}.cp), or change cluster.gpus_per_node")
    if cp == 1:
        return
    from ..validators.derived import boundary_width

    rows = st.seq_len * recipe.parallel.micro_batch_size
    m = recipe.model
    width = boundary_width(m.window_size, tuple(m.compress_ratios))
    if rows % cp or rows // cp < width:
        raise ContractViolation(
            f"{where}: a micro-batch of {rows} packed tokens does not split into cp={cp} equal slices of at least "
            f"the boundary width {width} (max(window_size, compressor context))",
            hint=f"raise curriculum.stages.{i}.seq_len to a multiple of {cp} that is >= {width * cp}, or lower cp")


class LRSchedule:
    """Learning rates of step ``s`` (0-based global step) over the whole curriculum."""

    def __init__(self, optimizer_cfg: Any, plans: list[StagePlan]) -> None:
        self.cfg = optimizer_cfg
        self.plans = plans
        self.total = plans[-1].end_step
        self.warmup = min(optimizer_cfg.warmup_steps, self.total)
        if optimizer_cfg.schedule == "wsd":
            self.decay_start = max(self.warmup, round(self.total * (1 - optimizer_cfg.decay_fraction)))
        elif optimizer_cfg.schedule == "cosine":
            self.decay_start = self.warmup
        else:
            self.decay_start = None  # constant: never decays

    def stage_of(self, step: int) -> StagePlan:
        """The stage that owns global step ``step`` (the last stage past the end)."""
        for plan in self.plans:
            if step < plan.end_step:
                return plan
        return self.plans[-1]

    def decay_started(self, step: int) -> bool:
        """True once the LR has started decaying (the MTP weight drops to loss_weight_after_decay)."""
        return self.decay_start is not None and step >= self.decay_start and self.decay_start < self.total

    def _shape(self, step: int) -> float:
        """Decay factor in [0, 1]: 1 before decay, 0 at the end of the run."""
        if self.decay_start is None or step < self.decay_start:
            return 1.0
        span = max(1, self.total - self.decay_start)
        progress = min(1.0, (step - self.decay_start + 1) / span)
        if self.cfg.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress  # wsd: linear cool-down

    def lr(self, step: int) -> tuple[float, float]:
        """(AdamW lr, Muon lr) for global step ``step``."""
        peak = self.stage_of(step).peak_lr
        min_lr = min(self.cfg.min_lr, peak)
        lr = min_lr + (peak - min_lr) * self._shape(step)
        if step < self.warmup:
            lr = peak * (step + 1) / self.warmup
        return lr, lr * self.cfg.muon_lr / self.cfg.lr
