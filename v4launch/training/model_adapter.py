"""The one place where a recipe touches the model: ``Recipe`` -> frozen ``ModelArgs``.

Style rule 4 (config flows one way): the model never sees the recipe. Field names of
``ModelArgs`` follow the released DeepSeek-V4 ``inference/model.py``; the recipe's
``model:`` section follows the released ``config.json``. This table is the mapping.
"""

from __future__ import annotations

from typing import Any

from ..errors import ContractViolation
from ..model import ModelArgs


RECIPE_PATHS: dict[str, str] = {
    "vocab_size": "model.vocab_size", "dim": "model.dim", "n_layers": "model.n_layers",
    "n_mtp_layers": "model.mtp.depth", "compress_ratios": "model.compress_ratios", "n_heads": "model.n_heads",
    "head_dim": "model.head_dim", "rope_head_dim": "model.rope_head_dim", "q_lora_rank": "model.q_lora_rank",
    "o_groups": "model.o_groups", "o_lora_rank": "model.o_lora_rank", "window_size": "model.window_size",
    "index_n_heads": "model.indexer.n_heads", "index_head_dim": "model.indexer.head_dim",
    "index_topk": "model.indexer.topk", "use_hadamard": "model.indexer.hadamard",
    "rope_theta": "model.rope.rope_theta", "compress_rope_theta": "model.rope.compress_rope_theta",
    "rope_factor": "model.rope.yarn.factor", "original_seq_len": "model.rope.yarn.original_seq_len",
    "beta_fast": "model.rope.yarn.beta_fast", "beta_slow": "model.rope.yarn.beta_slow",
    "n_routed_experts": "model.moe.n_routed_experts", "n_activated_experts": "model.moe.n_activated_experts",
    "n_shared_experts": "model.moe.n_shared_experts", "moe_inter_dim": "model.moe.moe_inter_dim",
    "route_scale": "model.moe.route_scale", "n_hash_layers": "model.moe.n_hash_layers",
    "swiglu_limit": "model.moe.swiglu_limit", "hc_mult": "model.mhc.hc_mult",
    "hc_sinkhorn_iters": "model.mhc.sinkhorn_iters", "hc_eps": "model.mhc.eps", "norm_eps": "model.norm_eps",
    "init_std": "model.init_std", "seed": "run.seed",
}
"""``ModelArgs`` field -> the recipe path it comes from: the one mapping table (also used to name the
recipe field in a released ``config.json`` mismatch)."""


def _lookup(recipe: Any, path: str) -> Any:
    value = recipe
    for part in path.split("."):
        value = getattr(value, part)
    return value


def model_args_from_recipe(recipe: Any) -> ModelArgs:
    """Build the model's ``ModelArgs`` from a validated ``Recipe``.

    Mapping: :data:`RECIPE_PATHS` (ModelArgs field -> recipe path; run.seed seeds the hash
    table and the indexer init).

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
    fields = {name: _lookup(recipe, path) for name, path in RECIPE_PATHS.items()}
    fields["compress_ratios"] = tuple(fields["compress_ratios"])
    try:
        return ModelArgs(**fields)
    except ValueError as exc:
        raise ContractViolation(f"the recipe's model section does not build a V4 model: {exc}",
                                hint="fix the named model.* field (see `v4launch validate`)") from None
