"""Model hyper-parameters: the frozen ``ModelArgs`` dataclass.

Spec: reference/v4-model-spec.md §1 (config) and §4 items 1 and 7.
Upstream: ``ModelArgs`` in ``inference/model.py`` of the released DeepSeek-V4-Flash
(field names follow it), plus ``config.json`` / ``inference/config.json`` for values.

Defaults are the released V4-Flash values, including ``compress_rope_theta = 160000``
and ``original_seq_len = 65536`` from the released configs (the 40000 / 0 defaults of
the upstream dataclass are never used by the released model, spec §4 item 1).
The model never sees a recipe: a recipe adapter builds ``ModelArgs`` and the model
reads only this object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

FLASH_COMPRESS_RATIOS: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
"""Released V4-Flash schedule: 43 decoder layers (2 SWA, 21 CSA, 20 HCA) + the MTP slot."""

VALID_RATIOS = (0, 4, 128)


def _fail(field: str, value: Any, rule: str, fix: str) -> None:
    raise ValueError(f"ModelArgs.{field}={value!r}: {rule}. Fix: {fix}.")


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of a DeepSeek-V4-style model (all sizes in elements, not bytes).

    ``compress_ratios`` has one entry per decoder layer followed by one per MTP
    layer: 0 = sliding-window only (SWA), 4 = CSA (overlapping compressor plus
    lightning indexer), 128 = HCA (non-overlapping compressor, no indexer).

    Raises:
        ValueError: on any inconsistent field; the message names the field, the
            value, the rule and the fix.
    """

    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_mtp_layers: int = 1
    compress_ratios: tuple[int, ...] = FLASH_COMPRESS_RATIOS
    # attention (one shared KV latent of head_dim channels, used as K and V)
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64  # RoPE on the LAST rope_head_dim channels, interleaved pairs
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128  # raw-token sliding window, the query itself included
    # lightning indexer (CSA layers only)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    use_hadamard: bool = True  # rotate indexer q/k by a normalised Hadamard matrix
    # rope / yarn
    rope_theta: float = 10000.0  # ratio-0 layers (SWA and MTP), no YaRN
    compress_rope_theta: float = 160000.0  # ratio 4/128 layers, with YaRN
    rope_factor: float = 16.0
    original_seq_len: int = 65536  # 0 disables YaRN frequency interpolation
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # moe
    n_routed_experts: int = 256
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2048
    route_scale: float = 1.5
    n_hash_layers: int = 3
    swiglu_limit: float = 10.0  # 0 disables the clamp
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # misc
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    seed: int = 0  # seeds the tid2eid hash table and freshly built indexers

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        n_slots = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n_slots:
            _fail("compress_ratios", self.compress_ratios,
                  f"needs n_layers + n_mtp_layers = {n_slots} entries, got {len(self.compress_ratios)}",
                  "give one ratio per decoder layer followed by one per MTP layer")
        bad = [r for r in self.compress_ratios if r not in VALID_RATIOS]
        if bad:
            _fail("compress_ratios", self.compress_ratios, f"values must be in {VALID_RATIOS}, got {bad}",
                  "use 0 (SWA), 4 (CSA) or 128 (HCA)")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim):
            _fail("rope_head_dim", self.rope_head_dim,
                  "must be even and at most head_dim and index_head_dim",
                  "pick an even rope_head_dim <= min(head_dim, index_head_dim)")
        if (self.n_heads * self.head_dim) % self.o_groups:
            _fail("o_groups", self.o_groups, f"must divide n_heads*head_dim={self.n_heads * self.head_dim}",
                  "choose a divisor of n_heads*head_dim (a divisor of n_heads groups whole heads)")
        if not 1 <= self.n_activated_experts <= self.n_routed_experts:
            _fail("n_activated_experts", self.n_activated_experts,
                  f"must be in [1, n_routed_experts={self.n_routed_experts}]", "lower n_activated_experts")
        if self.n_shared_experts not in (0, 1):
            _fail("n_shared_experts", self.n_shared_experts, "the released layout has at most one shared expert",
                  "use 0 or 1 (widen moe_inter_dim instead)")
        if not 0 <= self.n_hash_layers <= self.n_layers:
            _fail("n_hash_layers", self.n_hash_layers, f"must be in [0, n_layers={self.n_layers}]",
                  "hash routing only applies to the first decoder layers")
        if self.window_size < 1 or self.index_topk < 1 or self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            _fail("window_size/index_topk/hc_mult/hc_sinkhorn_iters",
                  (self.window_size, self.index_topk, self.hc_mult, self.hc_sinkhorn_iters),
                  "must all be >= 1", "use positive sizes")
        if self.use_hadamard and 4 in self.compress_ratios and self.index_head_dim & (self.index_head_dim - 1):
            _fail("index_head_dim", self.index_head_dim, "the Hadamard rotation needs a power of two",
                  "use a power-of-two index_head_dim or set use_hadamard=False")
        if self.tie_word_embeddings:
            _fail("tie_word_embeddings", True, "V4 has an untied head (released config: false)",
                  "set tie_word_embeddings=False")

    # ------------------------------------------------------------------ helpers
    def layer_ratio(self, layer_id: int) -> int:
        """Compression ratio of decoder layer ``layer_id`` (MTP layers: ``n_layers + k``)."""
        return self.compress_ratios[layer_id]

    def replace(self, **changes: Any) -> "ModelArgs":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_released_config(cls, config: Mapping[str, Any]) -> "ModelArgs":
        """Build from a released ``config.json`` (HF keys) or ``inference/config.json``.

        Both key styles of the April DeepSeek-V4 release are understood
        (e.g. ``hidden_size`` or ``dim``; ``rope_scaling.factor`` or ``rope_factor``).
        Quantisation, tokenizer and serving keys are ignored; an unknown key raises,
        so a later checkpoint format (spec §4 item 7) is not silently misread.

        Raises:
            ValueError: unknown key, or a value V4 does not support (e.g. a scoring
                function other than sqrtsoftplus, more than one KV head).
        """
        cfg = dict(config)
        out: dict[str, Any] = {}
        rope_scaling = cfg.pop("rope_scaling", None) or {}
        for key, val in rope_scaling.items():
            if key in _YARN_KEYS:
                out[_YARN_KEYS[key]] = val
            elif key != "type":
                _fail("rope_scaling." + key, val, "unknown rope_scaling key", "remove it or extend the mapping")
        if rope_scaling.get("type", "yarn") != "yarn":
            _fail("rope_scaling.type", rope_scaling["type"], "V4 uses YaRN", "set type to 'yarn'")
        for key, val in cfg.items():
            if key in _CHECKS:
                ok_value = _CHECKS[key]
                if val != ok_value:
                    _fail(key, val, f"DeepSeek-V4 requires {ok_value!r}", f"set {key} to {ok_value!r}")
                continue
            if key in _IGNORED:
                continue
            name = _KEY_MAP.get(key, key)
            if name not in _FIELDS:
                _fail(key, val, "unknown released-config key", "remove it, or map it in ModelArgs._KEY_MAP")
            out[name] = tuple(val) if name == "compress_ratios" else val
        return cls(**out)


_FIELDS = {f.name for f in dataclasses.fields(ModelArgs)}
_KEY_MAP = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads", "qk_rope_head_dim": "rope_head_dim", "sliding_window": "window_size",
    "num_experts_per_tok": "n_activated_experts", "moe_intermediate_size": "moe_inter_dim",
    "routed_scaling_factor": "route_scale", "num_hash_layers": "n_hash_layers", "rms_norm_eps": "norm_eps",
    "initializer_range": "init_std",
}
_YARN_KEYS = {"factor": "rope_factor", "original_max_position_embeddings": "original_seq_len",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow"}
_CHECKS = {"scoring_func": "sqrtsoftplus", "score_func": "sqrtsoftplus", "num_key_value_heads": 1,
           "attention_bias": False, "hidden_act": "silu", "norm_topk_prob": True}
_IGNORED = {
    "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "expert_dtype", "dtype",
    "scale_fmt", "quantization_config", "max_position_embeddings", "model_type", "topk_method",
    "torch_dtype", "transformers_version", "use_cache", "max_batch_size", "max_seq_len", "scale_dtype",
}
