"""Released-config traps and sanity limits: softmax scale, compressed RoPE base, lengths, top-k, vocab."""

from __future__ import annotations

import math
from pathlib import Path

from ..derived import CSA_RATIO, visible_compressed_entries
from ..schema.model import RELEASED_COMPRESS_ROPE_THETA
from .base import Context, rule

TOKENIZER_VOCAB = {"byte": 257}
"""Tokens each tokenizer emits: byte = 256 byte values + end-of-document."""


def tokenizer_json_vocab(path: str) -> int | None:
    """Largest id + 1 of a Hugging Face tokenizer.json (added tokens included); None when the file is not here
    or unreadable (the data preparation then says why)."""
    try:
        from tokenizers import Tokenizer

        return max(Tokenizer.from_file(str(Path(path).expanduser())).get_vocab(with_added_tokens=True).values()) + 1
    except Exception:  # missing or unreadable file: not this rule's finding
        return None


@rule("V4-SOFTMAX-SCALE", fields=("model.rope.softmax_scale", "model.head_dim"), scope="recipe",
      fix="remove model.rope.softmax_scale (null means head_dim**-0.5)")
def check_softmax_scale(ctx: Context):
    """The attention softmax scale is head_dim**-0.5; a scale folding in the YaRN mscale is rejected.

    Source: seed 004 item 1 (m_scale inflated logits ~1.277x); v4-model-spec §2 "Core attention" (no mscale).
    """
    scale = ctx.model.rope.softmax_scale
    if scale is None:
        return ctx.ok("model.rope.softmax_scale", None, "head_dim**-0.5")
    plain = ctx.model.head_dim ** -0.5
    if not math.isclose(scale, plain, rel_tol=1e-6):
        return ctx.finding("model.rope.softmax_scale", scale,
                           f"softmax_scale={scale:g} is {scale / plain:.3f}× head_dim**-0.5 = {plain:.6g}")
    return ctx.ok("model.rope.softmax_scale", scale)


@rule("V4-COMPRESS-ROPE-THETA", fields=("model.rope.compress_rope_theta", "model.init_from_released"), scope="recipe",
      fix="set model.rope.compress_rope_theta=160000 (every released config), or model.init_from_released=false")
def check_compress_theta(ctx: Context):
    """Starting from released weights, compress_rope_theta must be the released 160000 (40000 is only a dataclass default).

    Source: v4-model-spec §4 item 1 (config.json of Flash and Pro); seeds/README.md.
    """
    theta = ctx.model.rope.compress_rope_theta
    if not ctx.model.init_from_released:
        return ctx.na("not initialised from released weights")
    if theta != RELEASED_COMPRESS_ROPE_THETA:
        return ctx.finding("model.rope.compress_rope_theta", theta, f"compress_rope_theta={theta:g} differs from the released {RELEASED_COMPRESS_ROPE_THETA:g}")
    return ctx.ok("model.rope.compress_rope_theta", theta)


@rule("V4-SEQ-MAXPOS", fields=("curriculum.stages.*.seq_len", "model.max_position_embeddings"),
      fix="lower the stage's seq_len or raise model.max_position_embeddings (released: 1048576)")
def check_seq_maxpos(ctx: Context):
    """A stage's seq_len does not exceed model.max_position_embeddings.

    Source: v4-model-spec §1 (max_position_embeddings 1048576); torchtitan PR #4328 (max_context_length raises).
    """
    limit = ctx.model.max_position_embeddings
    if ctx.seq_len > limit:
        return ctx.finding(ctx.stage_path("seq_len"), ctx.seq_len, f"seq_len {ctx.seq_len} > max_position_embeddings {limit}")
    return ctx.ok(ctx.stage_path("seq_len"), ctx.seq_len, f"≤ {limit}")


@rule("V4-TOPK-VISIBLE", fields=("model.indexer.topk", "curriculum.stages.*.seq_len"), severity="warning",
      fix="lower model.indexer.topk or train this phase at a longer seq_len")
def check_topk_visible(ctx: Context):
    """The indexer top-k does not exceed the compressed entries a sequence has (seq_len / 4); otherwise the selection is dense.

    Source: v4-model-spec §2 "Indexer" (topk(min(index_topk, #entries))); seed 000 §2.
    """
    if 4 not in ctx.all_ratios or ctx.stage.phase == "dense":
        return ctx.na("no indexer in this stage")
    topk, visible = ctx.model.indexer.topk, visible_compressed_entries(ctx.seq_len, CSA_RATIO)
    if topk > visible:
        return ctx.finding("model.indexer.topk", topk, f"topk {topk} > {visible} compressed entries at seq_len {ctx.seq_len}")
    return ctx.ok("model.indexer.topk", topk, f"≤ {visible} entries")


@rule("V4-VOCAB", fields=("data.tokenizer", "model.vocab_size"), scope="recipe",
      fix="set model.vocab_size=257 or more for the byte tokenizer (256 bytes + end-of-document); for a tokenizer.json, its largest id + 1 or more")
def check_vocab(ctx: Context):
    """The tokenizer's vocabulary fits model.vocab_size (byte: 257; a tokenizer.json: its largest id + 1).

    Source: v4launch data pipeline (data.tokenizer); an id ≥ vocab_size indexes past the embedding.
    """
    tok = ctx.recipe.data.tokenizer
    need = TOKENIZER_VOCAB.get(tok) or tokenizer_json_vocab(tok)
    if need is None:
        return ctx.na(f"{tok} is not on this machine: checked when the data are prepared")
    if ctx.model.vocab_size < need:
        return ctx.finding("model.vocab_size", ctx.model.vocab_size, f"vocab_size {ctx.model.vocab_size} < {need} tokens of the {tok} tokenizer")
    return ctx.ok("model.vocab_size", ctx.model.vocab_size, f"≥ {need}")
