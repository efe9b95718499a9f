"""Parameter and buffer counts of the bundled V4 model, from the recipe's ``model:`` section alone.

Pure Python (never imports torch): this file lists, for one ``ModelConfig`` and attention phase, every
parameter and buffer ``V4Model`` builds, under the model's own names (FQNs) and shapes, the way
``model/model.py`` (``V4Model``, ``Block``, ``MTPLayer``), ``model/attention.py`` (``Attention``),
``model/compressor.py`` (``Compressor``), ``model/indexer.py`` (``Indexer``), ``model/moe.py``
(``Gate``, ``Expert``, ``MoE``) and ``model/mtp.py`` (``MTPBlock``) build them. The routed experts of
one layer are one entry ``layers.N.ffn.experts.*`` (E experts × w1, w2, w3), so a 43-layer, 256-expert
model is ~1,100 entries, not 33,000. ``tests/validators/test_param_count.py`` builds the model with
torch and compares every entry with ``named_parameters()`` / ``named_buffers()`` exactly.

Symbols (shapes are [out, in] as torch stores them): d = dim, H = n_heads, D = head_dim,
q = q_lora_rank, G = o_groups, R = o_lora_rank, hc = mhc.hc_mult, V = vocab_size,
E = moe.n_routed_experts, K = moe.n_activated_experts, I = moe.moe_inter_dim,
HI = indexer.n_heads, dI = indexer.head_dim; coff = 2 for ratio 4 (overlapping windows), else 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .schema.model import ModelConfig

OptimizerKind = Literal["muon", "adamw"]
Holder = Literal["E", "t", "m", "L"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter (or, for ``routed``, one layer's routed experts together).

    Attributes:
        name: the model's FQN (``layers.3.attn.wq_b.weight``; routed experts ``layers.3.ffn.experts.*``).
        numel: elements (the E experts' w1 + w2 + w3 for a routed entry).
        optimizer: "muon" for 2-D hidden matrices under ``optimizer.name: muon_adamw``, "adamw" for the
            embedding, head, RMSNorm gains, mHC parameters, ``ape``, ``attn_sink``, the router gate and
            every non-matrix (``v4launch/training/optim.py`` ``adamw_reason``).
        routed: routed-expert weights (sharded over EP, never FSDP-sharded).
        holder: the layout symbol whose pipeline stage holds it: E, t (decoder layer), m (MTP layer), L.
        layer: decoder layer id, or n_layers + k for MTP layer k; None for E and L parameters.
    """

    name: str
    numel: int
    optimizer: OptimizerKind
    routed: bool = False
    holder: Holder = "t"
    layer: int | None = None


@dataclass(frozen=True)
class BufferSpec:
    """One buffer: name, elements, bytes per element (int32 hash table, fp32 router bias, int64 counts)."""

    name: str
    numel: int
    itemsize: int
    holder: Holder = "t"
    layer: int | None = None


def _ratio(m: ModelConfig, layer: int) -> int:
    return m.compress_ratios[layer] if layer < len(m.compress_ratios) else 0


def _compressor(prefix: str, m: ModelConfig, head_dim: int, ratio: int) -> list[tuple[str, int, OptimizerKind]]:
    """``Compressor(dim, head_dim, ratio)``: ape [ratio, coff·hd], wkv / wgate [coff·hd, d], norm [hd]."""
    coff = 2 if ratio == 4 else 1
    return [(f"{prefix}ape", ratio * coff * head_dim, "adamw"),
            (f"{prefix}wkv.weight", coff * head_dim * m.dim, "muon"),
            (f"{prefix}wgate.weight", coff * head_dim * m.dim, "muon"),
            (f"{prefix}norm.weight", head_dim, "adamw")]


def attention_params(m: ModelConfig, ratio: int, with_indexer: bool, prefix: str = "attn.") -> list[tuple[str, int, OptimizerKind]]:
    """(name, numel, optimizer) of one ``Attention`` (model/attention.py ``Attention.__init__``)."""
    d, H, D, q = m.dim, m.n_heads, m.head_dim, m.q_lora_rank
    out: list[tuple[str, int, OptimizerKind]] = [
        (f"{prefix}attn_sink", H, "adamw"),
        (f"{prefix}wq_a.weight", q * d, "muon"),
        (f"{prefix}q_norm.weight", q, "adamw"),
        (f"{prefix}wq_b.weight", H * D * q, "muon"),
        (f"{prefix}wkv.weight", D * d, "muon"),
        (f"{prefix}kv_norm.weight", D, "adamw"),
        (f"{prefix}wo_a.weight", m.o_groups * m.o_lora_rank * (H * D // m.o_groups), "muon"),
        (f"{prefix}wo_b.weight", d * m.o_groups * m.o_lora_rank, "muon"),
    ]
    if ratio:
        out += _compressor(f"{prefix}compressor.", m, D, ratio)
        if ratio == 4 and with_indexer:
            ix = m.indexer
            out += [(f"{prefix}indexer.wq_b.weight", ix.n_heads * ix.head_dim * q, "muon"),
                    (f"{prefix}indexer.weights_proj.weight", ix.n_heads * d, "muon")]
            out += _compressor(f"{prefix}indexer.compressor.", m, ix.head_dim, 4)
    return out


def block_params(m: ModelConfig, layer: int, with_indexer: bool) -> list[ParamSpec]:
    """Every parameter of decoder layer ``layer`` (``layers.N.``) or MTP layer ``layer - n_layers``
    (``mtp.K.``): attention, MoE (gate, routed experts, shared expert), norms, mHC, MTP extras."""
    mtp = layer >= m.n_layers
    prefix = f"mtp.{layer - m.n_layers}." if mtp else f"layers.{layer}."
    holder: Holder = "m" if mtp else "t"
    d, hc, e = m.dim, m.mhc.hc_mult, m.moe
    n_mix = (2 + hc) * hc
    rows: list[tuple[str, int, OptimizerKind]] = attention_params(m, _ratio(m, layer), with_indexer)
    rows.append(("ffn.gate.weight", e.n_routed_experts * d, "adamw"))
    if e.n_shared_experts:
        rows += [(f"ffn.shared_experts.{w}.weight", d * e.moe_inter_dim, "muon") for w in ("w1", "w2", "w3")]
    rows += [("attn_norm.weight", d, "adamw"), ("ffn_norm.weight", d, "adamw")]
    for sub in ("attn", "ffn"):
        rows += [(f"hc_{sub}_fn", n_mix * hc * d, "adamw"), (f"hc_{sub}_base", n_mix, "adamw"),
                 (f"hc_{sub}_scale", 3, "adamw")]
    if mtp:
        rows += [("e_proj.weight", d * d, "muon"), ("h_proj.weight", d * d, "muon"), ("enorm.weight", d, "adamw"),
                 ("hnorm.weight", d, "adamw"), ("norm.weight", d, "adamw"), ("hc_head_fn", hc * hc * d, "adamw"),
                 ("hc_head_base", hc, "adamw"), ("hc_head_scale", 1, "adamw")]
    specs = [ParamSpec(prefix + name, n, opt, False, holder, layer) for name, n, opt in rows]
    routed = e.n_routed_experts * 3 * d * e.moe_inter_dim
    specs.append(ParamSpec(prefix + "ffn.experts.*", routed, "muon", True, holder, layer))
    return specs


def block_buffers(m: ModelConfig, layer: int) -> list[BufferSpec]:
    """Buffers of one block's MoE: ``gate.tid2eid`` [V, K] int32 (hash layers) or ``gate.bias`` [E] fp32,
    and ``expert_counts`` [E] int64 (model/moe.py ``Gate`` and ``MoE``)."""
    mtp = layer >= m.n_layers
    prefix = f"mtp.{layer - m.n_layers}." if mtp else f"layers.{layer}."
    holder: Holder = "m" if mtp else "t"
    e = m.moe
    gate = (BufferSpec(prefix + "ffn.gate.tid2eid", m.vocab_size * e.n_activated_experts, 4, holder, layer)
            if layer < e.n_hash_layers else BufferSpec(prefix + "ffn.gate.bias", e.n_routed_experts, 4, holder, layer))
    return [gate, BufferSpec(prefix + "ffn.expert_counts", e.n_routed_experts, 8, holder, layer)]


def model_params(m: ModelConfig, phase: str) -> list[ParamSpec]:
    """Every parameter of ``V4Model(args, phase)``: ``embed`` (E), the decoder layers (t), the MTP
    layers (m), and ``norm``, ``head``, ``hc_head_*`` (L). Indexers exist in phases warmup and sparse."""
    d, hc, V = m.dim, m.mhc.hc_mult, m.vocab_size
    with_indexer = phase != "dense"
    specs = [ParamSpec("embed.weight", V * d, "adamw", holder="E")]
    for layer in range(m.n_layers + m.mtp.depth):
        specs += block_params(m, layer, with_indexer)
    specs += [ParamSpec("norm.weight", d, "adamw", holder="L"), ParamSpec("head.weight", V * d, "adamw", holder="L"),
              ParamSpec("hc_head_fn", hc * hc * d, "adamw", holder="L"), ParamSpec("hc_head_base", hc, "adamw", holder="L"),
              ParamSpec("hc_head_scale", 1, "adamw", holder="L")]
    return specs


def model_buffers(m: ModelConfig) -> list[BufferSpec]:
    """Every buffer of ``V4Model`` (the MoE buffers of each decoder and MTP layer)."""
    return [b for layer in range(m.n_layers + m.mtp.depth) for b in block_buffers(m, layer)]


def component_totals(specs: list[ParamSpec]) -> dict[str, int]:
    """Elements per component, for the report: attention (incl. compressor), indexer, routed experts,
    shared expert, router, mHC, norms, embedding, head, MTP projections."""
    out: dict[str, int] = {}
    for s in specs:
        out[component_of(s.name)] = out.get(component_of(s.name), 0) + s.numel
    return out


def component_of(name: str) -> str:
    """Component of a parameter FQN (see :func:`component_totals`)."""
    parts = name.split(".")
    if ".experts." in name and ".shared_experts." not in name:
        return "routed experts"
    for key, comp in ((".indexer.", "indexer"), (".shared_experts.", "shared expert"), (".gate.", "router"),
                      (".e_proj.", "MTP projections"), (".h_proj.", "MTP projections")):
        if key in name:
            return comp
    if parts[0] in ("embed", "head"):
        return "embedding" if parts[0] == "embed" else "head"
    if parts[-1].startswith("hc_"):
        return "mHC"
    if parts[-1] == "weight" and len(parts) >= 2 and "norm" in parts[-2]:
        return "norms"
    return "attention"
