"""Activation bytes the bundled model keeps for backward, per token and per layer (pure Python).

The memory plan (``memory_plan.py``) multiplies these per-token figures by the rows a rank holds
(``micro_batch_size · seq_len / cp``), the layers of its pipeline stages and the micro-batches in flight.
Each figure is read off the model code: which tensors autograd saves (``save_for_backward`` of the custom
functions, the inputs of ``F.linear`` / einsum / elementwise ops), in which dtype. Symbols as in
``param_count``; a = bytes of an activation element (2 under bf16 autocast, 4 for an fp32 model), f = 4.
k = the indexer top-k as the kernel returns it; W = window; B = boundary rows.

Per decoder / MTP layer and token (bytes), by region (the names ``parallel.recompute_modules`` uses):

* mHC (model/mhc.py): each of the two mixings saves its input streams [hc, d] (the projection GEMM's
  operand, shared with ``hc_post``'s residual), ``hc_post`` saves the sub-layer output [d] and the
  fp32 mixes, post and comb weights: 2·(a·hc·d + a·d + 4·((2+hc)·hc + hc + hc²)). Sinkhorn's 20 rounds
  run in a compiled region on CUDA (recomputed, not saved).
* norms, ``layernorm`` (common.RMSNorm, attn_norm and ffn_norm): an fp32 copy of the input and the fp32
  normalised value: 2·8d; recomputed: the region input 2·a·d.
* attention (attention.py / kernels/layer.py): normed input a·d; q_norm 8q; qr a·q; the query
  up-projection (``mla_up_proj``: the per-head RMS norm keeps its input [H·D] and one fp32 scale per
  head) a·H·D + 4H, 0 when recomputed; the rotated query kept by the core: a·H·D (kernels) or its fp32
  query-chunk copies 4·H·D (reference path, the inputs of each checkpointed chunk); kv_norm 8D and the
  rotated KV a·D (kernels, in ``kv_all``) or 4D (reference, fp32); the kernel's output and log-sum-exp
  a·H·D + 4H (reference: 0, chunks are recomputed); the de-rotated output (einsum input) a·H·D; the wo_a
  output a·G·R.  Under both paths this is ~4 copies of the [H·D] query width: the dominant term of
  wide-headed models (V4-Flash: H·D = 32768).
* compressor (compressor.py, fp32 pooling): ratio 4 keeps the two-window slots [2, D] and their softmax
  [2, D] in fp32: 16D; ratio 128: 8D; plus the pooled entries' norm 8D/ratio.
* indexer (indexer.py, CSA layers in warmup/sparse): its query before and after the Hadamard rotation
  2·a·HI·dI (a·HI·dI without Hadamard), head weights 4·HI, its compressor 16·dI + 8·dI/4.
* top-k (kernels path, CSA with an indexer): the selection ``sel`` and the kernel's index table, int32:
  8k. KL (kernels path, sparse phase): teacher probabilities, log-softmax of the student (fp32) and two
  masks: 10k. On the reference path both live inside the checkpointed query chunks (not kept).
* MoE (moe.py): normed input a·d; router softplus input and scores (fp32) 8E; per routed slot (K per
  token): the dispatched row a·d, the clamped-SwiGLU's fp32 gate / up / clamps / silu (``moe_act``)
  20·I (recomputed: its bf16 inputs 2·a·I), its bf16 output a·I and the gathered expert output a·d;
  the shared expert 20·I + a·I (``moe_act``: 3·a·I; ``shared_experts`` recomputed: 0); ``moe``
  recomputed: the whole MoE keeps its input a·d only.

Outside the layers: the embedding's fp32 streams (+ (4 - a)·hc·d on the first layer) and the MTP
embeddings 4·depth·d; the head keeps the hc_head input copy 4·hc·d, the final norm 8d and the
cross-entropy's bf16 hidden, log-sum-exp and labels a·d + 12 (loss.py; logits only in chunks); each MTP
layer adds enorm / hnorm / e_proj / h_proj (16d + 8·hc·d + a·d + a·hc·d) and its own head (as above).
"""

from __future__ import annotations

from .schema.model import ModelConfig

RECOMPUTE_REGIONS = ("layernorm", "mla_up_proj", "moe_act", "shared_experts", "moe")
"""``parallel.recompute_modules`` names whose regions this model recomputes (core_attn and mlp are refused)."""


def layer_bytes_per_token(m: ModelConfig, ratio: int, phase: str, *, kernels: bool, act: int, topk: int,
                          recompute: frozenset[str] = frozenset()) -> dict[str, float]:
    """Bytes one decoder or MTP layer keeps for backward per local token, by region (module docstring).

    Args:
        m: the model section. ratio: the layer's compress ratio (0, 4, 128). phase: dense, warmup, sparse.
        kernels: the fused kernel path runs (triton on SM90), else the reference path.
        act: bytes per activation element (2 under bf16 autocast, 4 for an fp32 model).
        topk: top-k columns the kernel returns (the aligned top-k, at most the visible entries).
        recompute: ``parallel.recompute_modules`` names in force.
    Returns: {"mHC", "norms", "attention", "compressor", "indexer", "top-k", "moe"} -> bytes per token;
        "top-k" is reported as its own memory term by the plan.
    """
    d, H, D, q, hc, a = m.dim, m.n_heads, m.head_dim, m.q_lora_rank, m.mhc.hc_mult, act
    hd = H * D
    out: dict[str, float] = {}
    out["mHC"] = 2 * (a * hc * d + a * d + 4 * ((2 + hc) * hc + hc + hc * hc))
    out["norms"] = 2 * a * d if "layernorm" in recompute else 2 * 8 * d
    up_proj = 0 if "mla_up_proj" in recompute else a * hd + 4 * H
    if kernels:
        core = a * hd + (a * D) + (a * hd + 4 * H)
    else:
        core = 4 * hd + 4 * D
    out["attention"] = a * d + 8 * q + a * q + up_proj + core + 8 * D + a * hd + a * m.o_groups * m.o_lora_rank
    out["compressor"] = (16 * D if ratio == 4 else 8 * D) + 8 * D / ratio if ratio else 0.0
    with_indexer = ratio == 4 and phase != "dense"
    ix = m.indexer
    if with_indexer:
        rotations = 2 if ix.hadamard else 1
        out["indexer"] = rotations * a * ix.n_heads * ix.head_dim + 4 * ix.n_heads + 16 * ix.head_dim + 2 * ix.head_dim
    else:
        out["indexer"] = 0.0
    out["top-k"] = (8 * topk + (10 * topk if phase == "sparse" else 0)) if (with_indexer and kernels) else 0.0
    out["moe"] = _moe_bytes(m, a, recompute)
    return out


def _moe_bytes(m: ModelConfig, a: int, recompute: frozenset[str]) -> float:
    """MoE bytes per token (module docstring, MoE item)."""
    d, e = m.dim, m.moe
    if "moe" in recompute:
        return float(a * d)
    act = 2 * a * e.moe_inter_dim if "moe_act" in recompute else 20 * e.moe_inter_dim
    routed = e.n_activated_experts * (2 * a * d + act + a * e.moe_inter_dim)
    shared = 0 if "shared_experts" in recompute else e.n_shared_experts * (act + a * e.moe_inter_dim)
    return float(a * d + 8 * e.n_routed_experts + routed + shared)


def head_bytes_per_token(m: ModelConfig, act: int) -> float:
    """The main head (L): hc_head's fp32 stream copy, the final norm, the cross entropy's saved rows."""
    return 4 * m.mhc.hc_mult * m.dim + 8 * m.dim + act * m.dim + 12


def mtp_extra_bytes_per_token(m: ModelConfig, act: int) -> float:
    """One MTP layer beyond its block: enorm, hnorm, e_proj / h_proj inputs, and its own head."""
    d, hc = m.dim, m.mhc.hc_mult
    return 16 * d + 8 * hc * d + act * d + act * hc * d + head_bytes_per_token(m, act)


def embed_bytes_per_token(m: ModelConfig, act: int) -> float:
    """The embedding stage: the first layer's streams are fp32 (embedding output) instead of ``act``."""
    return (4 - act) * m.mhc.hc_mult * m.dim


def mtp_embeddings_bytes_per_token(m: ModelConfig) -> float:
    """The MTP embeddings [depth, T, d] fp32, computed with E and carried to the MTP layers."""
    return 4.0 * m.mtp.depth * m.dim
