"""The one place where a recipe touches the model: ``Recipe`` -> frozen ``ModelArgs``.

Style rule 4 (config flows one way): the model never sees the recipe. Field names of
``ModelArgs`` follow the released DeepSeek-V4 ``inference/model.py``; the recipe's
``model:`` section follows the released ``config.json``. This table is the mapping.
"""

from __future__ import annotations

from typing import Any

from ..errors import ContractViolation
from ..model import ModelArgs


def model_args_from_recipe(recipe: Any) -> ModelArgs:
    """Build the model's ``ModelArgs`` from a validated ``Recipe``.

    Mapping (recipe path -> ModelArgs field): model.* of the same name; model.mtp.depth ->
    n_mtp_layers; model.indexer.{n_heads, head_dim, topk, hadamard} -> index_n_heads,
    index_head_dim, index_topk, use_hadamard; model.rope.{rope_theta, compress_rope_theta};
    model.rope.yarn.{factor, original_seq_len, beta_fast, beta_slow} -> rope_factor,
    original_seq_len, beta_fast, beta_slow; model.moe.* of the same name; model.mhc.{hc_mult,
    sinkhorn_iters, eps} -> hc_mult, hc_sinkhorn_iters, hc_eps; run.seed -> seed (hash table
    and indexer init).

    Raises:
        ContractViolation: a recipe value the bundled model cannot honour (a custom
            ``model.rope.softmax_scale``) or one ``ModelArgs`` rejects (message names the field).
    """
    m = recipe.model
    if m.rope.softmax_scale is not None and abs(m.rope.softmax_scale - m.head_dim ** -0.5) > 1e-12:
        raise ContractViolation(
            f"model.rope.softmax_scale={m.rope.softmax_scale}: the bundled model always uses head_dim**-0.5 "
            f"= {m.head_dim ** -0.5:.6g} (no YaRN mscale, seed 004 item 1)",
            hint="remove model.rope.softmax_scale from the recipe")
    y = m.rope.yarn
    fields = dict(
        vocab_size=m.vocab_size, dim=m.dim, n_layers=m.n_layers, n_mtp_layers=m.mtp.depth,
        compress_ratios=tuple(m.compress_ratios), n_heads=m.n_heads, head_dim=m.head_dim,
        rope_head_dim=m.rope_head_dim, q_lora_rank=m.q_lora_rank, o_groups=m.o_groups,
        o_lora_rank=m.o_lora_rank, window_size=m.window_size,
        index_n_heads=m.indexer.n_heads, index_head_dim=m.indexer.head_dim, index_topk=m.indexer.topk,
        use_hadamard=m.indexer.hadamard,
        rope_theta=m.rope.rope_theta, compress_rope_theta=m.rope.compress_rope_theta, rope_factor=y.factor,
        original_seq_len=y.original_seq_len, beta_fast=y.beta_fast, beta_slow=y.beta_slow,
        n_routed_experts=m.moe.n_routed_experts, n_activated_experts=m.moe.n_activated_experts,
        n_shared_experts=m.moe.n_shared_experts, moe_inter_dim=m.moe.moe_inter_dim, route_scale=m.moe.route_scale,
        n_hash_layers=m.moe.n_hash_layers, swiglu_limit=m.moe.swiglu_limit,
        hc_mult=m.mhc.hc_mult, hc_sinkhorn_iters=m.mhc.sinkhorn_iters, hc_eps=m.mhc.eps,
        norm_eps=m.norm_eps, init_std=m.init_std, seed=recipe.run.seed,
    )
    try:
        return ModelArgs(**fields)
    except ValueError as exc:
        raise ContractViolation(f"the recipe's model section does not build a V4 model: {exc}",
                                hint="fix the named model.* field (see `v4launch validate`)") from None
