"""Refusals of recipe settings the bundled job does not implement (nothing is accepted and then ignored).

One small rule per feature, each failing only on a non-default value, so the default and the BF16 recipes
pass and a rule can be deleted the day its feature lands (``validators/field_coverage.py`` then names the
field's reader instead). ``tests/validators/test_field_coverage.py`` checks that every rule here fails a
recipe that sets its field, naming the field, the value and the fix.
"""

from __future__ import annotations

from .base import Context, rule


@rule("V4-UNIMPL-OFFLOAD", fields=("parallel.offload_modules",), scope="recipe",
      fix="set parallel.offload_modules=[] parallel.cpu_offloading=true parallel.recompute_granularity=full")
def check_offload_unimplemented(ctx: Context):
    """Per-module activation offload (parallel.offload_modules) is not implemented; parallel.cpu_offloading is.

    Source: validators/field_coverage.py (no reader of parallel.offload_modules in the job; model/parallel/offload.py
    moves the inputs of whole-layer-recomputed layers, parallel.cpu_offloading).
    """
    mods = list(ctx.parallel.offload_modules)
    if mods:
        return ctx.finding("parallel.offload_modules", mods, f"parallel.offload_modules={mods}: Megatron's per-module "
                           "activation offload is not implemented by the bundled job; what it offloads is the input "
                           "each layer keeps under whole-layer recompute (parallel.cpu_offloading)")
    return ctx.ok("parallel.offload_modules", mods)


@rule("V4-UNIMPL-INDEXER-QAT", fields=("attention.indexer_qat", "precision.policy.indexer_qk"), scope="recipe",
      fix="set attention.indexer_qat=false precision.policy.indexer_qk=bf16")
def check_indexer_qat_unimplemented(ctx: Context):
    """Low-precision indexer QK training (attention.indexer_qat) is not implemented: the bundled indexer scores in BF16/FP32.

    Source: validators/field_coverage.py (no reader of attention.indexer_qat in the job; model/indexer.py scores in the compute dtype).
    """
    if ctx.recipe.attention.indexer_qat:
        return ctx.finding("attention.indexer_qat", True, "attention.indexer_qat=true: FP8/FP4 indexer QK (QAT) is not "
                           "implemented by the bundled job; the indexer would score in "
                           f"{ctx.recipe.precision.dtype}")
    return ctx.ok("attention.indexer_qat", False)


@rule("V4-UNIMPL-BSHD", fields=("parallel.qkv_format",), scope="recipe", fix="set parallel.qkv_format=thd")
def check_bshd_unimplemented(ctx: Context):
    """The padded BSHD batch format (parallel.qkv_format=bshd) is not implemented: the job always packs THD.

    Source: validators/field_coverage.py (v4launch/data/packing.py packs every micro-batch as THD with cu_seqlens).
    """
    fmt = ctx.parallel.qkv_format
    if fmt != "thd":
        return ctx.finding("parallel.qkv_format", fmt, f"parallel.qkv_format={fmt}: the bundled job packs every "
                           "micro-batch as THD (cu_seqlens) and has no padded BSHD path")
    return ctx.ok("parallel.qkv_format", fmt)
