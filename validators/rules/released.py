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
      fix="set model.rope.softmax_scale=null (null means head_dim**-0.5)")
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
      fix="set model.max_position_embeddings to the longest seq_len (released: 1048576), or lower the stage's seq_len")
def check_seq_maxpos(ctx: Context):
    """A stage's seq_len does not exceed model.max_position_embeddings.

    Source: v4-model-spec §1 (max_position_embeddings 1048576); torchtitan PR #4328 (max_context_length raises).
    """
    limit = ctx.model.max_position_embeddings
    if ctx.seq_len > limit:
        longest = max(st.seq_len for st in ctx.recipe.curriculum.stages)
        return ctx.finding(ctx.stage_path("seq_len"), ctx.seq_len, f"seq_len {ctx.seq_len} > max_position_embeddings {limit}",
                           f"set model.max_position_embeddings={longest} (the curriculum's longest seq_len; released: "
                           f"1048576), or {ctx.stage_path('seq_len')}={limit}")
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
        return ctx.finding("model.vocab_size", ctx.model.vocab_size, f"vocab_size {ctx.model.vocab_size} < {need} tokens "
                           f"of the {tok} tokenizer", f"set model.vocab_size={need} (the {tok} tokenizer's ids; more is fine)")
    return ctx.ok("model.vocab_size", ctx.model.vocab_size, f"≥ {need}")


RELEASED_INDEX = "model.safetensors.index.json"
"""A released-format directory's index (checkpoints/released_config.py ``INDEX_NAME``)."""
IMPORT_RECORD = "released_import.json"
"""What ``v4launch checkpoint import`` writes beside its DCP checkpoint (checkpoints/released_import.py)."""


def released_init_problem(path_text: str, first_phase: str) -> tuple[str, str] | None:
    """(why, fix) when the job would refuse ``model.init_from_released`` at start, or None (fine or not readable
    here: a cluster path is checked by the job). Mirrors v4launch/training/released_init.py."""
    import json

    path = Path(path_text).expanduser()
    if (path / RELEASED_INDEX).is_file():
        return (f"{path} is a released-format directory, not an imported checkpoint",
                f"run `v4launch checkpoint import {path} --recipe RECIPE --out DIR`, then set model.init_from_released=DIR")
    try:
        record = json.loads((path / IMPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if record.get("indexer_layers") and first_phase == "dense":
        return ("the import holds trained indexers and the first stage is dense, which has none: they would be "
                "dropped and trained again at the warm-up", "start the curriculum with a warmup or sparse stage")
    if not record.get("indexer_layers") and first_phase == "sparse":
        return ("the import has no indexers and the first stage is sparse: untrained indexers would select the "
                "attended entries", "start the curriculum with a warmup stage")
    return None


@rule("V4-RELEASED-INIT", fields=("model.init_from_released", "curriculum.stages.*.phase"), scope="recipe",
      fix="point model.init_from_released at a `v4launch checkpoint import` output and start the curriculum in "
          "the phase its indexers allow")
def check_released_init(ctx: Context):
    """A run started from imported released weights begins in a phase that keeps their indexers (or trains new ones).

    Refused as the job refuses at start (released_init.py): a released-format directory instead of its import;
    trained indexers with a dense first stage (dropped, then retrained); no indexers with a sparse first stage.
    A path this machine cannot read is left to the job (it may exist on the cluster only).

    Source: v4launch/training/released_init.py load_released_init; checkpoints/released_import.py ImportRecord.
    """
    path = ctx.recipe.model.init_from_released
    if not path:
        return ctx.na("no init_from_released")
    problem = released_init_problem(str(path), ctx.recipe.curriculum.stages[0].phase)
    if problem:
        return ctx.finding("model.init_from_released", path, problem[0], fix=problem[1])
    return ctx.ok("model.init_from_released", path)
