"""How long each curriculum stage takes and what it costs: steps, step time, wall time, GPU-hours (pure Python).

``time_plan(recipe) -> TimePlan`` estimates, per stage, the seconds of one optimizer step on the cluster the
recipe names, as compute plus the terms one GPU cannot measure (docs/time-plan.md says what is counted and
what is not):

* compute: the step's FLOPs (``cost_model.unit_costs``: forward FLOPs per token of every layer, x3 for
  forward + backward, plus one more forward of every decoder / MTP layer under whole-layer recompute)
  spread over the world's GPUs, at an achieved fraction of the GPU's data-sheet bf16 peak that was measured on
  this product's own H200 runs (:data:`CALIBRATIONS`); x the pipeline's balance (max / mean stage cost) and
  its bubble ``(pp - 1) / (vpp · micro-batches)`` (1F1B, interleaved when vpp > 1);
* EP all-to-all: each token's K routed rows of ``dim`` bf16 sent out and back in forward, again in
  backward (and in the recompute, when it replays the MoE: :func:`ep_passes`), the way into the experts as e4m3 plus a scale per row under FP8 with
  ``precision.fp8_dispatch`` (:func:`ep_row_bytes`), the share bound for other nodes over
  ``cluster.inter_node_gb_per_s``, the rest over ``cluster.intra_node_gb_per_s`` (both links at once: the
  slower side counts);
* CP exchange: every compressed layer's all-gather of compressed entries (``derived``) and the boundary rows,
  forward, backward (the gradient of the gathered buffer) and the recompute;
* data parallel: FSDP2 (``parallel.distributed_optimizer``) gathers the stage's dense parameters in forward
  and backward and reduce-scatters their gradients, per micro-batch; without it, one gradient all-reduce per
  step; routed experts replicated over dp·cp / ep all-reduce their gradients.

A stage's wall time adds its held-out evaluations to steps x step time: ``eval_cost.evaluations`` of them (one
at the stage end, plus one after every ``logging.eval_interval_steps``-th step), each
``eval_cost.eval_step_fraction`` of a step (forward only over the held-out micro-batches).

No term is assumed to overlap another (the communication adds to the compute: an upper bound where the job
overlaps). Units: seconds, FLOPs, bytes, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import ceil
from typing import Any

from . import derived
from .cost_model import _common, _ratio, balance_ratio, stage_costs, unit_costs
from .eval_cost import eval_step_fraction, evaluations
from .layout import Layout
from .memory_storage import stored_low
from .param_count import model_params
from .pipeline_schedule import PlanUnavailable, virtual_stages
from .schema.cluster import GPU_INTERCONNECT_GB_S, GPU_PEAK_BF16_TFLOPS
from .schema.curriculum import Stage
from .schema.recipe import Recipe

H200_PEAK_FLOPS = GPU_PEAK_BF16_TFLOPS["H200"] * 1e12


@dataclass(frozen=True)
class Calibration:
    """An achieved throughput measured on one H200: FLOPs of this module's count / measured seconds.

    Attributes:
        name: what was measured (``label``: in a few words). source: the committed result file (and the row in it).
        flops_per_s: achieved FLOP/s on the H200 (this module's FLOP count of the measured step / its time).
        applies: which recipes take it (``calibration_for``).
    """

    name: str
    source: str
    flops_per_s: float
    applies: str
    label: str

    @property
    def fraction_of_peak(self) -> float:
        """flops_per_s / the H200's data-sheet dense bf16 peak (989 TFLOPS)."""
        return self.flops_per_s / H200_PEAK_FLOPS



def duration_text(seconds: float) -> str:
    """A duration (seconds) as the reports print it: '0.4 s' under ten seconds (so a column of short parts does
    not read 0 s beside a total of 1 s), '42 s' under two minutes, '6 min' under two hours, '3.2 h' under two days,
    else '12.4 d'. Shared by V4-SLURM-SEGMENTS' notes and validate's time-plan table."""
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 2 * 86400 else f"{seconds / 86400:.1f} d"


FP8_AS_BF16 = ("every calibration is bf16; FP8 measured 1.03x faster on compiled Flash-width blocks, H100 "
               "(benchmarks/results/fp8_experts_h100_2026-12-05.md): too small and too partial a gain to calibrate on")
"""Why an FP8 recipe is priced as bf16, as validate's time-plan note says it (``TimePlan.fp8_recipe``)."""


CALIBRATIONS = {
    "graph": Calibration(
        "bench_h200 shape (~1.1 B, dim 1024, 16 heads), 8,192 tokens per step, sparse, compiled + CUDA graph, "
        "bf16 parameters, AdamW step included: 121.6 ms",
        "benchmarks/results/train_step_h200_2026-12-03_19e7493_sparse_span_columns.json rows[0].ms",
        245.1e12, "compile.enable and compile.cuda_graph", "the ~1.1 B bench step, compiled + CUDA graph"),
    "eager_sparse": Calibration(
        "4 Flash-width layers (dim 4096, 64 heads x 512, indexer 64 x 128, CSA/HCA), the 8 of 256 routed experts one "
        "EP32 rank holds (top-6), 65,536 tokens, sparse, eager, bf16 expert weights under bf16 autocast, whole-layer "
        "recompute, forward + backward, RMSNorm / RoPE / mHC mixing / SwiGLU / MoE combine as compiled regions "
        "(model/regions.py): 2.48 s",
        "benchmarks/results/flash_width_h200_2026-12-05_619713a.json rows[0].ms",
        397.6e12, "eager runs, sparse stages", "4 Flash-width layers at 64K, sparse, eager"),
    "eager_dense": Calibration(
        "the same 4 Flash-width layers in the dense phase (CSA attends every visible compressed entry): 5.60 s",
        "benchmarks/results/flash_width_h200_2026-12-04_43bb3bb.json rows[3].ms",
        252.8e12, "eager runs, dense stages", "4 Flash-width layers at 64K, dense, eager"),
    "eager_warmup": Calibration(
        "the same 4 Flash-width layers in the warm-up phase on the Triton kernels (top-k attention plus the dense "
        "KL: teacher over every visible entry read as a range, student over the same entries, layer._DenseKL, once per "
        "step under whole-layer recompute): 3.72 s",
        "benchmarks/results/flash_width_h200_2026-12-05_619713a.json rows[1].ms",
        336.3e12, "eager runs, warm-up stages", "4 Flash-width layers at 64K, warm-up, eager"),
}
"""The H200 measurements the compute term is calibrated on (tests/validators/test_time_plan.py holds the
plan to each file, and to the dense-phase bench file it was not fitted on, within 20%). The eager figures are
benchmarks/flash_width.py's rows; a warm-up stage on ``kernel_backend: reference`` is much slower than its
figure (its dense KL in chunks of einsums; not measured at Flash width; docs/time-plan.md)."""


def calibration_key(recipe: Recipe, stage: Stage | None = None) -> str:
    """The :data:`CALIBRATIONS` key whose settings the stage runs (the first stage when None): a compiled,
    graph-replayed step (``graph``: the bench, every phase), else ``eager_<phase>`` (Flash-width layers)."""
    c = recipe.compile
    if c.enable and c.cuda_graph:
        return "graph"
    return f"eager_{(stage or recipe.curriculum.stages[0]).phase}"


def calibration_for(recipe: Recipe, stage: Stage | None = None) -> Calibration:
    """The measured throughput of :func:`calibration_key`."""
    return CALIBRATIONS[calibration_key(recipe, stage)]


def peak_flops(recipe: Recipe) -> float | None:
    """Data-sheet dense bf16 FLOP/s of ``cluster.gpu`` (None for CPU runs: no estimate)."""
    tflops = GPU_PEAK_BF16_TFLOPS.get(recipe.cluster.gpu)
    return None if tflops is None else tflops * 1e12


def link_gb_s(recipe: Recipe) -> tuple[float, float]:
    """(intra-node, inter-node) GB/s per GPU, one direction: the cluster's fields, else the GPU model's defaults."""
    c = recipe.cluster
    intra, inter = GPU_INTERCONNECT_GB_S.get(c.gpu, (0.0, 0.0))
    return (c.intra_node_gb_per_s or intra, c.inter_node_gb_per_s or inter)


def step_flops_per_token(recipe: Recipe, stage: Stage) -> float:
    """FLOPs of one trained token: 3x the forward FLOPs of every unit (``cost_model.unit_costs``), plus one more
    forward of every decoder and MTP layer under ``recompute_granularity: full`` (or of the recomputed modules
    under ``selective``: MoE, shared experts, the query up-projection)."""
    m, p = recipe.model, recipe.parallel
    units = unit_costs(m, stage.seq_len, stage.phase, recipe.attention.indexer_loss_coeff > 0)
    fwd = sum(sum(v) for v in units.values())
    layers = sum(units["t"]) + sum(units["m"])
    if p.recompute_granularity == "full":
        return 3 * fwd + layers
    if p.recompute_granularity == "selective":
        e, mods = m.moe, set(p.recompute_modules)
        per_layer = 0.0
        if mods & {"moe", "mlp"}:
            per_layer += _common(m, False) - _common(m, True) + 2.0 * 3 * m.dim * e.moe_inter_dim * (
                e.n_activated_experts + e.n_shared_experts)
        elif "shared_experts" in mods:
            per_layer += 2.0 * 3 * m.dim * e.moe_inter_dim * e.n_shared_experts
        if "mla_up_proj" in mods:
            per_layer += 2.0 * m.q_lora_rank * m.n_heads * m.head_dim
        return 3 * fwd + per_layer * (m.n_layers + m.mtp.depth)
    return 3 * fwd


def _layout(recipe: Recipe, stage: Stage) -> tuple[float, int]:
    """(max / mean cost of the virtual stages, MoE layers on the busiest pipeline rank)."""
    m, p = recipe.model, recipe.parallel
    try:
        stages = virtual_stages(recipe)
    except PlanUnavailable:
        return 1.0, ceil((m.n_layers + m.mtp.depth) / p.pp)
    units = unit_costs(m, stage.seq_len, stage.phase, recipe.attention.indexer_loss_coeff > 0)
    costs = stage_costs(Layout(tuple(stages)), units)
    per_rank = [sum(1 for s in stages[r::p.pp] for sym in s if sym in "tm") for r in range(p.pp)]
    return (balance_ratio(costs) if len(costs) > 1 else 1.0), max(per_rank)


def _group_seconds(nbytes: float, group: int, gpus_per_node: int, intra: float, inter: float, ring: bool) -> float:
    """Seconds to move ``nbytes`` per GPU in a collective of ``group`` ranks (laid out over as few nodes as
    possible). A ring (all-gather, reduce-scatter, all-reduce) runs at its slowest link; an all-to-all sends
    each peer an equal share, the other nodes' share over the inter-node link while the rest crosses NVLink."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    if ring:
        return nbytes / ((intra if group <= gpus_per_node else inter) * 1e9)
    local = min(group, gpus_per_node) - 1
    remote = group - 1 - local
    return max(nbytes * local / (group - 1) / (intra * 1e9), nbytes * remote / (group - 1) / (inter * 1e9) if remote else 0.0)


@dataclass(frozen=True)
class StageTime:
    """One stage's estimate (seconds unless named otherwise).

    Attributes:
        steps: optimizer steps (``steps``, or ``ceil(tokens / tokens_per_step)``). tokens_per_step: global.
        flops_per_step: FLOPs of one step, all GPUs. compute_s: compute of one step on the busiest GPU,
            balance and bubble included. ep_s, cp_s, dp_s: the communication terms of one step.
        step_s: compute_s + ep_s + cp_s + dp_s. evaluations: held-out evaluations in the stage (its end, plus
            one every ``logging.eval_interval_steps`` steps). eval_s: their seconds, each
            ``eval_cost.eval_step_fraction`` x step_s. wall_s: steps x step_s + eval_s.
            gpu_hours: wall_s / 3600 x world.
        calibration: the :data:`CALIBRATIONS` key its compute is priced at.
        segments: Slurm jobs of ``slurm.time_min`` the stage needs (each gives ``time_min x 60 -
            signal_delay_s`` seconds of training).
    """

    name: str
    steps: int
    tokens_per_step: int
    flops_per_step: float
    compute_s: float
    bubble: float
    ep_s: float
    cp_s: float
    dp_s: float
    step_s: float
    evaluations: int
    eval_s: float
    wall_s: float
    gpu_hours: float
    segments: int
    calibration: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def segment_seconds(recipe: Recipe) -> float:
    """Training seconds one Slurm job gives: ``slurm.time_min`` minus the checkpoint signal's lead."""
    s = recipe.slurm
    return max(1.0, s.time_min * 60.0 - s.signal_delay_s)


def ep_passes(recipe: Recipe) -> int:
    """Times a micro-batch's rows cross the EP all-to-all (out and back each time): forward and backward, plus the
    recompute's forward when it replays the MoE (``recompute_granularity: full``, or ``selective`` with ``moe`` /
    ``mlp`` in ``recompute_modules``: ``model/parallel/recompute.py``'s table of replayed collectives)."""
    p = recipe.parallel
    replays = p.recompute_granularity == "full" or (p.recompute_granularity == "selective"
                                                     and bool(set(p.recompute_modules) & {"moe", "mlp"}))
    return 3 if replays else 2


def fp8_dispatch_applies(recipe: Recipe) -> bool:
    """Whether the job exchanges the rows into the routed experts as e4m3 (``precision.fp8_dispatch``): an FP8
    recipe with bf16 compute on an SM90+ GPU (where the routed experts run FP8: ``parallel.precision.apply_fp8``)
    and ``parallel.ep`` > 1."""
    pr = recipe.precision
    return (pr.fp8_recipe != "none" and pr.fp8_dispatch and pr.dtype == "bf16" and recipe.parallel.ep > 1
            and (recipe.cluster.sm or 0) >= 90)


def ep_row_bytes(recipe: Recipe) -> int:
    """Bytes one routed row puts on the EP all-to-all per pass (forward, backward or recompute), out and back:
    2 x dim x 2 in bf16; with :func:`fp8_dispatch_applies`, the way into the experts (the forward's rows, the
    backward's output gradients) is dim e4m3 bytes plus a float32 scale: dim + 4 + 2 x dim."""
    dim = recipe.model.dim
    return dim + 4 + 2 * dim if fp8_dispatch_applies(recipe) else 2 * dim * 2


def stage_time(recipe: Recipe, index: int) -> StageTime | None:
    """The estimate of curriculum stage ``index``; None for a CPU target or a stage whose DP is undefined."""
    peak = peak_flops(recipe)
    stage = recipe.curriculum.stages[index]
    dp = recipe.stage_dp(stage)
    if peak is None or dp is None:
        return None
    m, p, c = recipe.model, recipe.parallel, recipe.cluster
    cp, gpn = recipe.stage_cp(stage), c.gpus_per_node
    intra, inter = link_gb_s(recipe)
    batch = recipe.stage_global_batch(stage)
    tokens = batch * stage.seq_len
    steps = stage.steps if stage.steps is not None else ceil(stage.tokens / tokens)
    flops = step_flops_per_token(recipe, stage) * tokens
    key = calibration_key(recipe, stage)
    achieved = peak * CALIBRATIONS[key].fraction_of_peak
    balance, moe_layers = _layout(recipe, stage)
    accum = max(1, batch // max(1, dp * p.micro_batch_size))
    bubble = (p.pp - 1) / (p.vpp * accum) if p.pp > 1 else 0.0
    compute = flops / c.world_size / achieved * balance * (1 + bubble)
    local_tokens = tokens / (dp * cp)
    a2a = (local_tokens * moe_layers * m.moe.n_activated_experts * ep_row_bytes(recipe) * ep_passes(recipe)
           * (p.ep - 1) / p.ep)
    ep_s = _group_seconds(a2a, p.ep, gpn, intra, inter, ring=False)
    cp_passes = 3 if p.recompute_granularity == "full" else 2  # forward, backward (+ the whole layer's replay)
    cp_s = _group_seconds(_cp_bytes(recipe, stage, cp) * batch / dp * moe_layers / max(1, m.n_layers + m.mtp.depth)
                          * cp_passes, cp, gpn, intra, inter, ring=True)
    dp_s = _dp_seconds(recipe, dp * cp, accum, gpn, intra, inter)
    step = compute + ep_s + cp_s + dp_s
    n_eval = evaluations(steps, recipe.logging.eval_interval_steps)
    eval_s = n_eval * eval_step_fraction(dp, accum, recompute=p.recompute_granularity == "full") * step
    wall = steps * step + eval_s
    return StageTime(stage.name, steps, tokens, flops, compute, bubble, ep_s, cp_s, dp_s, step, n_eval, eval_s, wall,
                     wall / 3600 * c.world_size, ceil(wall / segment_seconds(recipe)), key)


def _cp_bytes(recipe: Recipe, stage: Stage, cp: int) -> float:
    """Bytes one CP rank receives per sequence in one pass over every layer: the other ranks' share of each
    compressed layer's gathered entries (bf16 KV and, past the dense phase, indexer keys) and the left
    neighbour's boundary rows (bf16, ``dim`` wide)."""
    if cp <= 1:
        return 0.0
    m = recipe.model
    ratios = [_ratio(m, i) for i in range(m.n_layers + m.mtp.depth)]
    gathered = derived.allgather_bytes_total(stage.seq_len, ratios, kv_dim=m.head_dim, index_dim=m.indexer.head_dim,
                                             with_indexer=stage.phase != "dense")
    boundary = derived.boundary_width(m.window_size, m.compress_ratios) * m.dim * 2 * len(ratios)
    return gathered * (cp - 1) / cp + boundary


def _dp_seconds(recipe: Recipe, shard: int, accum: int, gpn: int, intra: float, inter: float) -> float:
    """Data-parallel collectives of one step on the busiest pipeline rank (module docstring): dense parameters
    at their stored width (bf16 under ``precision.params_dtype: bf16``, else fp32), routed experts' gradients
    over their dp·cp / ep replicas."""
    p = recipe.parallel
    dense = routed = 0.0
    for sp in model_params(recipe.model, "sparse"):
        width = 2 if stored_low(recipe, sp) else 4
        if sp.routed:
            routed += sp.numel * width / p.ep
        else:
            dense += sp.numel * width
    dense /= p.pp
    routed /= p.pp
    share = (shard - 1) / shard if shard > 1 else 0.0
    if p.distributed_optimizer and shard > 1:  # FSDP2: gather forward + backward, reduce-scatter, per micro-batch
        dense_s = _group_seconds(3 * accum * dense * share, shard, gpn, intra, inter, ring=True)
    else:
        dense_s = _group_seconds(2 * dense * share, shard, gpn, intra, inter, ring=True)
    replicas = max(1, shard // p.ep)
    routed_s = _group_seconds(2 * routed * (replicas - 1) / replicas, replicas, gpn, intra, inter, ring=True)
    return dense_s + routed_s


@dataclass(frozen=True)
class TimePlan:
    """Every stage's estimate and the curriculum's totals (seconds, GPU-hours, steps, Slurm segments)."""

    stages: tuple[StageTime, ...]
    world: int
    gpu: str
    peak_tflops: float
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    segment_s: float
    priced_as_triton: tuple[str, ...] = ()
    """Stages whose attention runs a kernel backend other than triton: priced at the calibrations, which are the
    Triton kernels' (no other backend is measured; the reference path is slower, its warm-up much slower)."""
    fp8_recipe: str = "none"
    """``precision.fp8_recipe``. Every calibration is a bf16 measurement, so an FP8 recipe's compute is priced as
    bf16 (:data:`FP8_AS_BF16`)."""
    fp8_dispatch: bool = False
    """:func:`fp8_dispatch_applies`: the EP bytes are priced with e4m3 rows into the experts (:func:`ep_row_bytes`)."""

    @property
    def wall_s(self) -> float:
        return sum(s.wall_s for s in self.stages)

    @property
    def gpu_hours(self) -> float:
        return sum(s.gpu_hours for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        used = list(dict.fromkeys(s.calibration for s in self.stages))
        return {"stages": [s.to_dict() for s in self.stages],
                "total": {"steps": sum(s.steps for s in self.stages), "wall_s": self.wall_s, "gpu_hours": self.gpu_hours,
                          "evaluations": sum(s.evaluations for s in self.stages),
                          "eval_s": sum(s.eval_s for s in self.stages),
                          "segments": sum(s.segments for s in self.stages)},
                "assumptions": {"gpu": self.gpu, "world": self.world, "peak_tflops": self.peak_tflops,
                                "calibrations": [{"key": k, "label": CALIBRATIONS[k].label,
                                                  "achieved_fraction_of_peak": round(CALIBRATIONS[k].fraction_of_peak, 4),
                                                  "measured": CALIBRATIONS[k].name, "source": CALIBRATIONS[k].source}
                                                 for k in used],
                                "intra_node_gb_per_s": self.intra_node_gb_per_s,
                                "inter_node_gb_per_s": self.inter_node_gb_per_s, "segment_s": self.segment_s,
                                "priced_as_triton": list(self.priced_as_triton), "fp8_recipe": self.fp8_recipe,
                                "fp8_dispatch": self.fp8_dispatch}}


def time_plan(recipe: Recipe) -> TimePlan | None:
    """The whole curriculum's estimate; None when any stage has none (a CPU target, DP undefined)."""
    stages = [stage_time(recipe, i) for i in range(len(recipe.curriculum.stages))]
    if any(s is None for s in stages):
        return None
    intra, inter = link_gb_s(recipe)
    priced_as_triton = tuple(st.name for st in recipe.curriculum.stages
                       if (st.kernel_backend or recipe.attention.kernel_backend) != "triton")
    return TimePlan(tuple(stages), recipe.cluster.world_size, recipe.cluster.gpu, GPU_PEAK_BF16_TFLOPS[recipe.cluster.gpu],
                    intra, inter, segment_seconds(recipe), priced_as_triton, recipe.precision.fp8_recipe,
                    fp8_dispatch_applies(recipe))
