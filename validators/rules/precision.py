"""Precision-policy rules: which components stay BF16 / FP32 under FP8, and what FP8 needs."""

from __future__ import annotations

from .base import Context, rule


@rule("V4-PREC-BF16-PINS", fields=("precision.policy.compressor_gemm", "precision.policy.indexer_weights_proj",
                                   "precision.fp8_recipe"), scope="recipe",
      fix="set precision.policy.compressor_gemm=bf16 precision.policy.indexer_weights_proj=bf16")
def check_bf16_pins(ctx: Context):
    """Compressor GEMMs and the indexer head-weight projection stay BF16, also under an FP8 recipe.

    Source: Megatron csa.py:1064, :1495, :1597 (built outside fp8_model_init); seed 000 §9.
    """
    pol = ctx.recipe.precision.policy
    found = [ctx.finding(f"precision.policy.{name}", getattr(pol, name), f"{name}={getattr(pol, name)}; it must stay bf16")
             for name in ("compressor_gemm", "indexer_weights_proj") if getattr(pol, name) != "bf16"]
    return found or ctx.ok("precision.policy.compressor_gemm", pol.compressor_gemm)


@rule("V4-PREC-FP32-PINS", fields=("precision.policy.ape", "precision.policy.attn_sink"), scope="recipe",
      fix="set precision.policy.ape=fp32 precision.policy.attn_sink=fp32")
def check_fp32_pins(ctx: Context):
    """The compressor positional bias (ape) and the attention sink stay FP32: both feed a softmax directly.

    Source: Megatron mark_keep_in_fp32 (csa.py); v4-model-spec §1 dtype table; seed 004 item 6f.
    """
    pol = ctx.recipe.precision.policy
    found = [ctx.finding(f"precision.policy.{name}", getattr(pol, name), f"{name}={getattr(pol, name)}; it must stay fp32")
             for name in ("ape", "attn_sink") if getattr(pol, name) != "fp32"]
    return found or ctx.ok("precision.policy.ape", pol.ape)


@rule("V4-PREC-INDEXER-QK", fields=("precision.policy.indexer_qk", "attention.indexer_qat"), scope="recipe",
      fix="set precision.policy.indexer_qk=bf16 (a low-precision indexer QK needs attention.indexer_qat, which the "
          "bundled job does not implement: V4-UNIMPL-INDEXER-QAT)")
def check_indexer_qk(ctx: Context):
    """The indexer QK stays high precision (BF16) unless low-precision indexer QAT is explicitly enabled.

    Source: seed 004 items 4 and 6 (a low-precision selector silently changes which entries are attended); seed 000 §9.
    """
    qk = ctx.recipe.precision.policy.indexer_qk
    if qk != "bf16" and not ctx.recipe.attention.indexer_qat:
        return ctx.finding("precision.policy.indexer_qk", qk, f"indexer QK in {qk} without attention.indexer_qat")
    return ctx.ok("precision.policy.indexer_qk", qk)


@rule("V4-PREC-FP32-DISTOPT-PP", fields=("precision.keep_fp32_params", "parallel.distributed_optimizer", "parallel.pp"),
      scope="recipe",
      fix="set precision.keep_fp32_params=false (FP32 master copies keep update precision), or "
          "parallel.distributed_optimizer=false")
def check_fp32_distopt_pp(ctx: Context):
    """FP32-pinned parameters with the distributed optimizer at PP > 1 are rejected (mixed-dtype optimizer groups).

    Source: seed 004 item 9 (every GPU aborted at 4 nodes / PP4 / EP8); seed 000 §9 and §12 item 7.
    """
    keep, p = ctx.recipe.precision.keep_fp32_params, ctx.parallel
    if keep and p.distributed_optimizer and p.pp > 1:
        return ctx.finding("precision.keep_fp32_params", keep, f"keep_fp32_params with distributed_optimizer and pp={p.pp}")
    return ctx.ok("precision.keep_fp32_params", keep)


@rule("V4-FP8-SM", fields=("precision.fp8_recipe", "cluster.gpu"), scope="recipe",
      fix="set precision.fp8_recipe=none (no FP8 GEMMs); or target an SM89+ GPU (H100, H200, B200) with blockwise or "
          "delayed (this job does not run mxfp8: V4-FP8-BUILD)")
def check_fp8_sm(ctx: Context):
    """An FP8 recipe needs FP8 tensor cores (SM89+); mxfp8 needs SM100+ (Blackwell).

    Source: NVIDIA Transformer Engine FP8 / MXFP8 recipe documentation.
    """
    fp8, sm = ctx.recipe.precision.fp8_recipe, ctx.sm
    if fp8 == "none":
        return ctx.na("fp8_recipe=none")
    need = 100 if fp8 == "mxfp8" else 89
    if sm is None or sm < need:
        where = "a CPU target" if sm is None else f"SM{sm}"
        return ctx.finding("precision.fp8_recipe", fp8, f"fp8_recipe={fp8} needs SM{need}+, cluster.gpu={ctx.recipe.cluster.gpu} is {where}")
    return ctx.ok("precision.fp8_recipe", fp8, f"SM{sm}")


FP8_ALIGNMENT = 16
"""FP8 GEMMs need in and out features that are multiples of 16 (torchao float8; the tensor cores' FP8 tile)."""


def fp8_gemm_sizes(m) -> dict[str, int]:
    """The in/out sizes of the GEMMs the V4 policy sends to FP8 (model/parallel/precision.py fp8_module_filter)."""
    sizes = {"model.dim": m.dim, "model.q_lora_rank": m.q_lora_rank, "model.n_heads·head_dim": m.n_heads * m.head_dim,
             "model.head_dim": m.head_dim, "model.o_groups·o_lora_rank": m.o_groups * m.o_lora_rank}
    sizes["model.moe.moe_inter_dim"] = m.moe.moe_inter_dim  # the routed experts' FP8 grouped GEMM (and the shared)
    return sizes


@rule("V4-FP8-BUILD", fields=("precision.fp8_recipe", "model.dim", "model.q_lora_rank", "model.head_dim",
                              "model.n_heads", "model.o_lora_rank", "model.o_groups", "model.moe.moe_inter_dim"),
      scope="recipe", fix="set precision.fp8_recipe=none (no FP8 GEMMs); or blockwise / delayed with model dimensions "
                          "that are multiples of 16")
def check_fp8_build(ctx: Context):
    """FP8: dense GEMMs via torchao float8, routed experts via model/fp8_experts.py; no mxfp8; sizes multiples of 16.

    mxfp8 is refused (torchao's MX formats are not wired). The dense GEMMs run ``delayed`` as torchao tensorwise and
    ``blockwise`` as rowwise scaling (printed at job start); the routed experts run rowwise e4m3 forward and
    input-gradient GEMMs with bf16 weight gradients under either recipe (bf16 compute on SM90+,
    model/fp8_experts.py). Every GEMM the V4 policy sends to FP8
    (wq_a dim→q_lora_rank, wq_b q_lora_rank→n_heads·head_dim, wkv dim→head_dim, wo_b
    o_groups·o_lora_rank→dim, the routed experts' grouped GEMM and the shared expert dim↔moe_inter_dim, the MTP
    projections dim→dim)
    needs both sizes to be multiples of 16.

    Source: model/parallel/precision.py apply_fp8; torchao float8 (convert_to_float8_training); model/fp8_experts.py
    (torch._scaled_grouped_mm)."""
    fp8, m = ctx.recipe.precision.fp8_recipe, ctx.recipe.model
    if fp8 == "none":
        return ctx.na("fp8_recipe=none")
    if fp8 == "mxfp8":
        if ctx.sm is None or ctx.sm < 100:
            return ctx.na("mxfp8 below SM100: V4-FP8-SM refuses it")
        return ctx.finding("precision.fp8_recipe", fp8, "fp8_recipe=mxfp8: the bundled job runs FP8 through torchao "
                           "float8 (tensorwise / rowwise scaling); MX block formats are not wired")
    bad = {k: v for k, v in fp8_gemm_sizes(m).items() if v % FP8_ALIGNMENT}
    if bad:
        return ctx.finding("precision.fp8_recipe", fp8, f"fp8_recipe={fp8}: FP8 GEMMs need sizes that are multiples "
                           f"of {FP8_ALIGNMENT}, and " + ", ".join(f"{k}={v}" for k, v in bad.items()) + " is not")
    runs_as = {"delayed": "tensorwise scaling (from the current amax, no history)",
               "blockwise": "rowwise scaling (not 1x128 / 128x128 blocks)"}[fp8]
    return ctx.ok("precision.fp8_recipe", fp8, f"dense GEMMs as torchao float8 {runs_as}, routed experts as "
                  "rowwise e4m3 (model/fp8_experts.py); sizes aligned")
