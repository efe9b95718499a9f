"""Attention-module rules: TP, layer schedule, output groups, recompute/offload, kernel gates."""

from __future__ import annotations

from ..schema.attention import FUSED_BACKENDS
from ..recompute_policy import (GRANULARITY, SELECTIVE_FIX, RecomputeRefused, recompute_regions,
                                replayed_collectives)
from .base import Context, rule


@rule("V4-TP-ONE", fields=("parallel.tp",), scope="recipe",
      fix="set parallel.tp=1; scale attention with CP (long sequences) and DP/EP instead")
def check_tp_one(ctx: Context):
    """Tensor parallelism must be 1: V4 hybrid attention has no TP path.

    Source: Megatron-LM transformer_config.py:1760 and deepseek_v4_hybrid_attention.py:90; seed 000 §11.1.
    """
    tp = ctx.parallel.tp
    if tp != 1:
        return ctx.finding("parallel.tp", tp, f"tp={tp}, but DSv4 hybrid attention only supports TP size 1")
    return ctx.ok("parallel.tp", tp)


@rule("V4-RATIOS-LENGTH", fields=("model.compress_ratios", "model.n_layers", "model.mtp.depth"), scope="recipe",
      fix="give model.compress_ratios one entry per decoder layer, then one per MTP layer (released: …, 4, 0)")
def check_ratios_length(ctx: Context):
    """compress_ratios has exactly one entry per decoder layer plus one per MTP layer.

    Source: v4-model-spec §1 (Flash 44 = 43 + 1 entries); Megatron transformer_config.py:1753.
    """
    m = ctx.model
    want, got = m.n_layers + m.mtp.depth, len(m.compress_ratios)
    if got != want:
        return ctx.finding("model.compress_ratios", f"<{got} entries>",
                           f"{got} entries, but n_layers + mtp.depth = {m.n_layers} + {m.mtp.depth} = {want}")
    return ctx.ok("model.compress_ratios", f"<{got} entries>")


@rule("V4-OGROUPS", fields=("model.n_heads", "model.head_dim", "model.o_groups"), scope="recipe",
      fix="choose model.o_groups dividing n_heads·head_dim (released: 8 for Flash, 16 for Pro)")
def check_o_groups(ctx: Context):
    """n_heads × head_dim must be divisible by o_groups (grouped output projection).

    Source: Megatron deepseek_v4_hybrid_attention.py:173; v4-model-spec §2 "Output".
    """
    m = ctx.model
    width = m.n_heads * m.head_dim
    if width % m.o_groups:
        return ctx.finding("model.o_groups", m.o_groups, f"n_heads·head_dim = {width} is not divisible by o_groups={m.o_groups}")
    return ctx.ok("model.o_groups", m.o_groups)


def recompute_problem(recipe) -> RecomputeRefused | None:
    """The refusal of the recipe's recompute setting (``recompute_policy.recompute_regions``, the one the job
    applies too), or None when the job honours it."""
    p = recipe.parallel
    try:
        recompute_regions(p.recompute_granularity, p.recompute_modules, n_shared_experts=recipe.model.moe.n_shared_experts)
    except RecomputeRefused as refused:
        return refused
    return None


@rule("V4-RECOMPUTE", fields=("parallel.recompute_granularity", "parallel.recompute_modules"), scope="recipe",
      fix=SELECTIVE_FIX)
def check_recompute(ctx: Context):
    """Recompute only what the bundled job can replay: never core attention.

    Refused (``validators/recompute_policy.py``, the job's own refusals): ``core_attn`` (between the CP boundary
    exchange and the compressed all-gather; the attention path already recomputes each query chunk's scores);
    ``mlp`` (every V4 FFN is a MoE); ``shared_experts`` without shared experts; ``selective`` without modules
    (Megatron's default is core_attn); ``none`` or ``full`` with modules (they would be ignored). Accepted:
    selective layernorm, mla_up_proj, moe_act, shared_experts, moe; ``full`` (every layer whole).

    Source: Megatron deepseek_v4_hybrid_attention.py:94-99 and transformer_config.py:2192; seed 000 §10;
    validators/recompute_policy.py; model/parallel/recompute.py.
    """
    refused = recompute_problem(ctx.recipe)
    if refused:
        return ctx.finding(refused.field, refused.value, refused.why, refused.fix)
    p = ctx.parallel
    return ctx.ok(GRANULARITY, p.recompute_granularity, ", ".join(p.recompute_modules))


@rule("V4-RECOMPUTE-REPLAY", fields=("parallel.recompute_granularity", "parallel.recompute_modules"), scope="recipe",
      severity="warning",
      fix="nothing to change when the memory plan needs it (V4-MEMORY); measure the step with and without "
          "(benchmarks/recompute_memory.py --configs none,full) and, where memory allows, prefer selective "
          "recompute of the regions without collectives (layernorm, mla_up_proj, moe_act, shared_experts)")
def check_recompute_replay(ctx: Context):
    """A recompute region that encloses collectives replays them in backward: correct, but it costs step time.

    ``full`` at cp > 1 replays the CP boundary exchange and the compressed all-gathers of every layer; ``full``
    or ``moe`` at ep > 1 replay the expert all-to-all, and at cp > 1 the balance loss's CP sums.

    Source: seed 000 §10 ("an outer recompute boundary that encloses boundary exchange or compressed
    all-gathers would replay communication during backward ... evaluated in end-to-end step time");
    validators/recompute_policy.py ``replayed_collectives``.
    """
    p = ctx.parallel
    try:
        regions = recompute_regions(p.recompute_granularity, p.recompute_modules,
                                    n_shared_experts=ctx.model.moe.n_shared_experts)
    except RecomputeRefused:
        return ctx.na("V4-RECOMPUTE refuses the setting")
    max_cp = max(ctx.recipe.stage_cp(st) for st in ctx.recipe.curriculum.stages)
    replays = replayed_collectives(regions, max_cp=max_cp, ep=p.ep)
    value = p.recompute_granularity if p.recompute_granularity == "full" else list(p.recompute_modules)
    field = GRANULARITY if p.recompute_granularity == "full" else "parallel.recompute_modules"
    if replays:
        return ctx.finding(field, value, f"recompute replays {'; '.join(replays)} in backward")
    return ctx.ok(field, value)


@rule("V4-OFFLOAD-QKV", fields=("parallel.offload_modules",), scope="recipe",
      fix="set parallel.offload_modules=[] (the bundled job offloads no single module, V4-UNIMPL-OFFLOAD; "
          "parallel.cpu_offloading offloads each layer's input under whole-layer recompute)")
def check_offload(ctx: Context):
    """QKV-linear activation offload is not supported by V4 hybrid attention.

    Source: Megatron deepseek_v4_hybrid_attention.py:94-99; seed 000 §10.
    """
    mods = list(ctx.parallel.offload_modules)
    if "qkv_linear" in mods:
        return ctx.finding("parallel.offload_modules", mods, "'qkv_linear' offload is rejected by V4 hybrid attention")
    return ctx.ok("parallel.offload_modules", mods)


@rule("V4-KERNEL-SM90", fields=("attention.kernel_backend", "curriculum.stages.*.kernel_backend", "cluster.gpu"),
      fix="set the kernel_backend to reference; or target an SM90+ GPU (cluster.gpu: H100, H200, B200, …)")
def check_kernel_sm(ctx: Context):
    """Fused kernel backends (triton, cudnn) need an SM90-or-newer GPU.

    Source: Megatron transformer_config.py:1774 (cudnn: SM90+); seed 000 §8.1.
    """
    backend = ctx.backend
    if backend not in FUSED_BACKENDS:
        return ctx.na(f"kernel_backend={backend}")
    if ctx.sm is None or ctx.sm < 90:
        where = "a CPU target" if ctx.sm is None else f"SM{ctx.sm}"
        return ctx.finding(ctx.backend_field, backend, f"fused backend '{backend}' on cluster.gpu={ctx.recipe.cluster.gpu} ({where})",
                           f"set {ctx.backend_field}=reference; or target an SM90+ GPU (cluster.gpu: H100, H200, B200, …)")
    return ctx.ok(ctx.backend_field, backend, f"SM{ctx.sm}")


@rule("V4-KERNEL-TRITON-SM90", fields=("attention.kernel_backend", "curriculum.stages.*.kernel_backend", "cluster.gpu"),
      severity="warning",
      fix="set the kernel_backend to reference for this GPU (what the job runs there anyway); or target H100/H200 (SM90)")
def check_triton_sm90_only(ctx: Context):
    """The triton backend runs its kernels on SM90 only; on a newer GPU the job runs the reference attention.

    Source: model/kernels/dispatch.py (``_triton_problem``: compute capability must be 9.0; the kernels
    use Hopper wgmma tiles and are tuned and tested on H100/H200); docs/kernels.md.
    """
    if ctx.backend != "triton":
        return ctx.na(f"kernel_backend={ctx.backend}")
    if ctx.sm is None or ctx.sm < 90:
        return ctx.na("a target V4-KERNEL-SM90 already refuses")
    if ctx.sm == 90:
        return ctx.ok(ctx.backend_field, "triton", "SM90")
    return ctx.finding(ctx.backend_field, "triton",
                       f"kernel_backend 'triton' on cluster.gpu={ctx.recipe.cluster.gpu} (SM{ctx.sm}): the Triton kernels "
                       "run on SM90 only, so this stage would run the reference attention",
                       f"set {ctx.backend_field}=reference (what the job runs on SM{ctx.sm} anyway); or target "
                       "H100/H200 (SM90)")


@rule("V4-SM90-DENSE-LOSS", fields=("cluster.gpu", "attention.kernel_backend", "curriculum.stages.*.phase",
                                    "curriculum.stages.*.indexer_loss", "attention.indexer_loss_coeff"),
      fix="run the stage with kernel_backend=triton or reference (a warm-up stage always trains the dense KL target)")
def check_sm90_dense_loss(ctx: Context):
    """On SM90 the cuDNN dense-DSA path is rejected for a dense indexer loss; the Triton kernels train it.

    Source: Megatron transformer_config.py:1781-1791 and seed 000 §8.1 reject the cudnn backend's dense-loss
    path on SM90. The product's Triton backend trains the dense KL with its sparse-phase teacher and student
    kernels over every visible entry (model/kernels/layer.py ``_DenseKL``), held to float64 at V4-Flash's widths
    on an H200 (tests/model/kernels/test_kernels_triton.py::test_fused_warmup_kl_at_flash_width_matches_float64),
    so this rule does not refuse it. The job ties the KL target to the phase (V4-PHASE-INDEXER-TARGET), so
    the fix is the stage's kernels, never its indexer_loss.
    """
    s, sm = ctx.stage, ctx.sm
    if sm is None or sm // 10 != 9:
        return ctx.na("not an SM90 target")
    if ctx.backend not in FUSED_BACKENDS or 4 not in ctx.all_ratios:
        return ctx.na(f"kernel_backend={ctx.backend}" if 4 in ctx.all_ratios else "no ratio-4 layer")
    if s.phase == "dense" or ctx.recipe.attention.indexer_loss_coeff <= 0:
        return ctx.na("no indexer loss in this stage")
    field = ctx.stage_path("indexer_loss" if s.indexer_loss else "phase")
    value = s.indexer_loss or s.phase
    if s.effective_indexer_loss == "dense" and ctx.backend == "cudnn":
        fix = f"set {ctx.stage_path('kernel_backend')}=triton"
        if s.phase == "sparse":  # a dense override of a sparse stage: the job trains the sparse target
            fix = f"set {ctx.stage_path('indexer_loss')}=null (the phase sets the KL target)"
        return ctx.finding(field, value, f"dense indexer loss with the '{ctx.backend}' dense-DSA path on SM{sm}", fix)
    return ctx.ok(field, value)


@rule("V4-KERNEL-AVAILABLE", fields=("attention.kernel_backend", "curriculum.stages.*.kernel_backend"),
      fix="use kernel_backend=triton (fused, SM90) or reference; cudnn needs FlashMLA + cuDNN DSA, which v4launch does not ship")
def check_kernel_available(ctx: Context):
    """The kernel backend must be one the bundled model runs: reference or triton (cudnn is not shipped).

    Source: docs/kernels.md (model/kernels/dispatch.py raises BackendUnavailable for cudnn); Megatron
    transformer_config.py:1771 (cudnn needs flash_mla and cudnn.DSA importable).
    """
    if ctx.backend == "cudnn":
        return ctx.finding(ctx.backend_field, ctx.backend,
                           "kernel_backend 'cudnn' (FlashMLA + cuDNN DSA) is not available in the bundled model: "
                           "the job would stop at its first forward",
                           _available_fix(ctx))
    return ctx.ok(ctx.backend_field, ctx.backend)


def _available_fix(ctx: Context) -> str:
    """V4-KERNEL-AVAILABLE's fix: on SM90 triton first (the fused kernels, warm-up stages included:
    V4-SM90-DENSE-LOSS refuses only the cudnn dense-loss path), then reference; elsewhere reference. The first
    alternative is the one ``validate``'s combined fix merges: with reference first, flash_4n on cudnn was
    offered reference plus 8 nodes where triton alone passes on its 4."""
    reference = f"{ctx.backend_field}=reference"
    if ctx.sm != 90:
        return f"set {reference} (the triton kernels run on SM90 only: V4-KERNEL-TRITON-SM90)"
    return f"set {ctx.backend_field}=triton (the fused kernels on SM90), or {reference} (plain PyTorch, slower)"
