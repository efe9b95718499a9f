"""Model-shape rules: the ``model:`` section builds the bundled V4 model (what ``ModelArgs`` checks at job start)."""

from __future__ import annotations

from .base import Context, rule


def shape_problems(m) -> list[tuple[bool, str, object, str, str]]:
    """(refused?, field, value, what is wrong, fix) for each shape check of ``ModelArgs`` that the schema leaves
    to this rule, in the order the job checks them (``m``: the recipe's ``model`` section)."""
    r, hd = m.rope_head_dim, m.indexer.head_dim
    return [
        (r % 2, "model.rope_head_dim", r, f"rope_head_dim={r} is odd: RoPE rotates channel pairs",
         "use an even model.rope_head_dim"),
        (r > min(m.head_dim, hd), "model.rope_head_dim", r, f"rope_head_dim={r} is more than head_dim={m.head_dim} "
         f"or indexer.head_dim={hd}: RoPE takes the trailing rope_head_dim channels of both",
         f"use model.rope_head_dim <= {min(m.head_dim, hd)}"),
        (m.moe.n_shared_experts > 1, "model.moe.n_shared_experts", m.moe.n_shared_experts,
         "the V4 layout has at most one shared expert", "use 0 or 1 (widen model.moe.moe_inter_dim instead)"),
        (m.moe.n_hash_layers > m.n_layers, "model.moe.n_hash_layers", m.moe.n_hash_layers,
         f"n_hash_layers={m.moe.n_hash_layers} is more than n_layers={m.n_layers}",
         f"use model.moe.n_hash_layers <= {m.n_layers}"),
        (m.indexer.hadamard and m.has_csa and hd & (hd - 1), "model.indexer.head_dim", hd,
         f"indexer.head_dim={hd} is not a power of two, which the indexer's Hadamard rotation needs",
         "use a power of two (released: 128), or model.indexer.hadamard=false"),
    ]


@rule("V4-MODEL-BUILD", fields=("model.rope_head_dim", "model.head_dim", "model.indexer.head_dim",
                                "model.indexer.hadamard", "model.moe.n_shared_experts", "model.moe.n_hash_layers",
                                "model.n_layers"), scope="recipe",
      fix="change the named model.* field as its note says (the released shapes: rope_head_dim 64, "
          "indexer.head_dim 128, one shared expert, 3 hash layers)")
def check_model_build(ctx: Context):
    """The model section builds the bundled model (rope_head_dim, shared experts, hash layers, indexer head).

    rope_head_dim even and at most head_dim and indexer.head_dim; at most one shared expert; n_hash_layers at most
    n_layers; with the Hadamard rotation and a CSA layer, indexer.head_dim a power of two.

    Source: model/args.py ``ModelArgs.__post_init__`` (the job builds the model from it); v4-model-spec §1–§3
    (RoPE rotates channel pairs of the trailing rope_head_dim of q, k and the indexer's q, k; one shared expert;
    hash routing in the first layers; the indexer's Walsh–Hadamard rotation).
    """
    for bad, field, value, message, fix in shape_problems(ctx.model):
        if bad:
            return ctx.finding(field, value, message, fix)
    return ctx.ok("model.rope_head_dim", ctx.model.rope_head_dim, "the model section builds the bundled model")
