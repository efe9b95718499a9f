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
  save nothing on CUDA (model/kernels/triton_sinkhorn.py: one kernel each way, the backward recomputes the
  rounds from the [hc, hc] logits, counted in the fp32 term).
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
* warm-up KL gradient (kernels path, CSA, warm-up): formed in the forward and kept to the backward, with or
  without recompute (:func:`warmup_kl_gradient_bytes`).
* top-k (kernels path, CSA with an indexer): the selection ``sel`` and the kernel's index table, int32:
  8k. KL (kernels path, sparse phase): teacher probabilities, log-softmax of the student (fp32) and two
  masks: 10k. On the reference path both live inside the checkpointed query chunks (not kept).
* MoE (moe.py): normed input a·d; router softplus input and scores (fp32) 8E; per routed slot (K per
  token): the dispatched row a·d, the clamped-SwiGLU's fp32 gate / up / clamps / silu (``moe_act``)
  20·I (recomputed: its bf16 inputs 2·a·I), its bf16 output a·I and the gathered expert output a·d;
  the shared expert 20·I + a·I (``moe_act``: 3·a·I; ``shared_experts`` recomputed: 0); ``moe``
  recomputed: the whole MoE keeps its input a·d only.
* whole layer (granularity ``full``): the layer keeps its input streams a·hc·d only; in backward one layer
  at a time is re-run, holding the figures above (with its compressed KV, top-k and bf16 weight copies)
  as a transient.

Outside the layers: the embedding's fp32 streams (+ (4 - a)·hc·d on the first layer) and the MTP
embeddings 4·depth·d; the head keeps the hc_head input copy 4·hc·d, the final norm 8d and the
cross-entropy's bf16 hidden, log-sum-exp and labels a·d + 12 (loss.py; logits only in chunks); each MTP
layer adds enorm / hnorm / e_proj / h_proj (16d + 8·hc·d + a·d + a·hc·d) and its own head (as above).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import derived
from .schema.model import ModelConfig

KERNEL_DS_CAP_BYTES = 2 * (1 << 30)
"""The fused attention backward's dS buffer is capped at 2 GiB per query chunk (docs/kernels.md)."""

FP8_PEAK_MARGIN_GIB = 8.9
"""FP8's measured peak over bf16's (GiB): 2 compiled Flash-width layers (8 routed experts, 393,216 routed rows,
whole-layer recompute, one H100), 58.7 -> 67.6 GiB (benchmarks/results/fp8_experts_h100_2026-12-05.md)."""


def fp8_peak_note(stages: list[tuple[str, int, int | None]], offloading: bool = False) -> str:
    """What the memory plan says of an FP8 recipe (it has no FP8 terms): the measured margin, and the stages that
    would not fit their budget with it. stages: (name, planned total bytes, budget bytes or None); offloading:
    ``parallel.cpu_offloading`` is already on (the fix then does not propose it)."""
    gib = float(1 << 30)
    note = ("activations and transients are priced as bf16; measured on 2 compiled Flash-width layers (8 routed "
            "experts, 393,216 routed rows, whole-layer recompute, one H100) the FP8 peak was "
            f"{FP8_PEAK_MARGIN_GIB} GiB above bf16's (58.7 -> 67.6 GiB: "
            "benchmarks/results/fp8_experts_h100_2026-12-05.md): keep that much of the budget free")
    short = [f"{name} ({total / gib:.1f} + {FP8_PEAK_MARGIN_GIB} > {budget / gib:.1f} GiB)"
             for name, total, budget in stages if budget and total + FP8_PEAK_MARGIN_GIB * gib > budget]
    if short:
        offload = "" if offloading else ", host offload (parallel.cpu_offloading)"
        note += ("; with that margin these stages would not fit (a note: V4-MEMORY does not add it): "
                 + ", ".join(short) + f". Fix: more nodes (cluster.nodes){offload}, or precision.fp8_recipe=none")
    return note



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


def warmup_kl_gradient_bytes(m: ModelConfig, ratio: int, s: "StageSetting") -> float:
    """Bytes per local row the fused warm-up KL keeps from a CSA layer's forward to its backward (kernels path,
    warm-up phase; ``model/kernels/layer._DenseKL`` forms the indexer's gradient in the forward, and keeps it
    under whole-layer recompute too, where the replay skips the KL): dq a·HI·dI, dw 4·HI, and the key gradient
    4·dI per compressed entry (all seq_len / 4 of them, CP-gathered) spread over the rows. 0 elsewhere."""
    if not (s.kernels and s.phase == "warmup" and ratio == 4):
        return 0.0
    ix = m.indexer
    return float(s.act * ix.n_heads * ix.head_dim + 4 * ix.n_heads + 4 * ix.head_dim * (s.seq_len // 4) / s.rows)


def block_input_bytes_per_token(m: ModelConfig, act: int) -> float:
    """What a layer keeps under whole-layer recompute (granularity ``full``): its input streams [hc, d]
    (the checkpoint's saved input; the first layer's fp32 streams are counted by the embedding's term)."""
    return float(act * m.mhc.hc_mult * m.dim)


def head_bytes_per_token(m: ModelConfig, act: int) -> float:
    """The main head (L): hc_head's fp32 stream copy, the final norm, the cross entropy's saved rows."""
    return 4 * m.mhc.hc_mult * m.dim + 8 * m.dim + act * m.dim + 12


def mtp_input_bytes_per_token(m: ModelConfig, act: int) -> float:
    """What an MTP layer's ``mtp_input`` keeps for backward: the enorm / hnorm inputs and statistics and the
    e_proj / h_proj inputs (``parallel.cpu_offloading`` moves them to host memory with the block's input)."""
    d, hc = m.dim, m.mhc.hc_mult
    return 16 * d + 8 * hc * d + act * d + act * hc * d


def mtp_extra_bytes_per_token(m: ModelConfig, act: int) -> float:
    """One MTP layer beyond its block: enorm, hnorm, e_proj / h_proj inputs, and its own head."""
    return mtp_input_bytes_per_token(m, act) + head_bytes_per_token(m, act)


def embed_bytes_per_token(m: ModelConfig, act: int) -> float:
    """The embedding stage: the first layer's streams are fp32 (embedding output) instead of ``act``."""
    return (4 - act) * m.mhc.hc_mult * m.dim


def mtp_embeddings_bytes_per_token(m: ModelConfig) -> float:
    """The MTP embeddings [depth, T, d] fp32, computed with E and carried to the MTP layers."""
    return 4.0 * m.mtp.depth * m.dim


@dataclass(frozen=True)
class StageSetting:
    """The stage-effective settings the per-layer figures read (built by ``memory_plan``): rows per rank, seq_len,
    cp, the S = dp·cp ranks, micro-batches per step, activation bytes, kernel path, top-k, phase, recompute, chunk,
    whether the step is replayed from a CUDA graph (its gradients then stay allocated), and whether the layers'
    input streams go to host memory (``parallel.cpu_offloading``)."""

    rows: int
    seq_len: int
    cp: int
    shard: int
    accum: int
    act: int
    kernels: bool
    topk: int
    phase: str
    recompute: frozenset
    chunk: int
    captured: bool = False
    offload: bool = False


QUERY_BLOCK_HEADS = (16, 32)
"""Head counts whose kernel backward runs in query blocks (model/kernels/triton_attention_query_blocks.py)."""
SPAN_ROWS_PER_COLUMN = 2
"""Sparse CSA's top-k columns run in query blocks as a masked span where a segment's entries are at most this
many per column (model/kernels/triton_attention.py, ``SPAN_PER_COLUMN``; tests/validators check they agree)."""


def attention_workspace(m, ratio: int, s: StageSetting) -> float:
    """Peak transient of one layer's attention backward: the kernel's dS buffer (capped), or on the
    reference path one recomputed query chunk: fp32 logits / probabilities / their gradients
    [R, H, W + n] and the gathered keys [R, n, D] with their gradient (n = the entries a chunk reads).
    At 16 / 32 heads the kernels' sparse-phase CSA backward runs in query blocks (``triton_attention.attention_bwd``):
    over the whole span of a segment's entries (n = seq_len / 4) with a uint8 selection mask [R, n + 1] where
    that span is at most SPAN_ROWS_PER_COLUMN per top-k column, else the window there and the columns in the single
    pass, which adds to the window's float32 partial dQ [R, H, D]."""
    if ratio == 0:
        n = 0
    elif ratio == 128:
        n = s.seq_len // 128
    else:
        n = s.seq_len // 4 if s.phase == "dense" else s.topk
    H, W = m.n_heads, m.window_size
    if s.kernels:
        extra = 0
        if ratio == 4 and s.phase != "dense" and H in QUERY_BLOCK_HEADS:
            span = s.seq_len // 4
            if span <= SPAN_ROWS_PER_COLUMN * s.topk:
                n, extra = span, s.rows * (span + 1)
            else:
                extra = 4 * s.rows * H * m.head_dim
        return float(min(KERNEL_DS_CAP_BYTES, s.rows * H * (W + n) * 4) + extra)
    r = min(s.chunk, s.rows)
    teacher = 4 * r * H * (s.seq_len // 4) if (ratio == 4 and s.phase == "warmup") else 0
    return float(16 * r * H * (W + n) + 8 * r * n * m.head_dim * (ratio == 4) + teacher)


def backward_working_set(m, s: StageSetting) -> float:
    """Gradients alive while one layer runs its backward: of the streams (two [hc, d]) and of the widest
    intermediate, the query / output pair [H·D] of the attention or the fp32 SwiGLU of the K routed slots."""
    e = m.moe
    widest = max(2 * s.act * m.n_heads * m.head_dim, 12 * e.n_activated_experts * e.moe_inter_dim)
    return float(s.rows * (widest + 2 * s.act * m.mhc.hc_mult * m.dim))


def compressed_bytes(m, ratio: int, s: StageSetting, with_indexer: bool) -> float:
    """Compressed entries one layer holds for a micro-batch: the (CP-gathered, fixed-capacity) buffer of
    main KV and indexer keys, the copy the core reads (bf16 in ``kv_all``, fp32 on the reference path),
    and under CP the extended input (boundary rows + local rows) with its boundary KV."""
    a, d, D = s.act, m.dim, m.head_dim
    out = 0.0
    if ratio:
        width = D + (m.indexer.head_dim if with_indexer else 0)
        entries = s.cp * derived.cp_capacity_rows(s.rows, ratio) if s.cp > 1 else s.rows // ratio
        out += entries * width * a + entries * D * (a if s.kernels else 4)
    if s.cp > 1:
        b = derived.boundary_width(m.window_size, m.compress_ratios)
        out += (s.rows + b) * a * d + b * (8 * D + a * D)
    return out
