"""Derived figures of a recipe stage: pure functions of plain numbers (no schema, no torch).

Everything here is shared with the runtime: the model's context-parallel code imports
``boundary_width`` and ``cp_capacity_rows`` so the validator and the runtime can never
disagree, and the CP byte-counting test compares the runtime's collectives against
``csa_allgather_bytes`` / ``hca_allgather_bytes``.

Units: lengths in tokens (rows), sizes in bytes, FLOPs per token. "1M tokens" in seed
000 §5.5 means 10**6; a 1M curriculum stage of this project uses 2**20 = 1048576.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import gcd

CSA_RATIO = 4
"""Compression ratio of CSA layers (overlapping compressor + lightning indexer)."""

HCA_RATIO = 128
"""Compression ratio of HCA layers (non-overlapping compressor, no indexer)."""

CSA_OVERLAP_ROWS = 8
"""Left rows a ratio-4 group reads: the overlapping compressor pools 2 windows (coff = 2)."""

BF16_BYTES = 2
"""Bytes per element of the gathered compressed state (BF16)."""


def compress_width(ratio: int) -> int:
    """Left context (tokens) one compressed group of ``ratio`` needs: 8 for ratio 4, ``ratio`` for
    ratio > 1, 0 for window-only layers (Megatron ``csa_utils/cp_utils.py:198``)."""
    if ratio == CSA_RATIO:
        return CSA_OVERLAP_ROWS
    return ratio if ratio > 1 else 0


def boundary_width(window_size: int, compress_ratios: Iterable[int]) -> int:
    """Rows each CP rank receives from its left neighbour: max(window, d_comp) in tokens.

    d_comp is the largest compressor context over the ratios present: 8 when ratio-4 (CSA)
    layers exist, 128 when ratio-128 (HCA) layers exist, 0 for window-only models
    (seed 000 §5.1; Megatron ``cp_utils.py:198-199``, ``D_window = max(window, d_comp)``).
    Every CP rank must hold at least this many local rows (``V4-CP-BOUNDARY``).

    >>> boundary_width(128, [0, 4, 128])
    128
    >>> boundary_width(64, [0, 4])
    64
    >>> boundary_width(4, [4, 128])
    128
    """
    d_comp = max((compress_width(int(r)) for r in compress_ratios), default=0)
    return max(int(window_size), d_comp)


def local_rows(seq_len: int, cp: int) -> int:
    """Token rows each CP rank holds under the contiguous partition: seq_len // cp.

    The partition requires ``seq_len % cp == 0`` (Megatron ``data_schedule_utils.py:79``);
    the floor is what each rank gets when that rule is violated.
    """
    return seq_len // cp


def compressed_entries(seq_len: int, ratio: int) -> int:
    """Completed compressed entries of one sequence: floor(seq_len / ratio); the tail makes none."""
    return seq_len // ratio if ratio > 0 else 0


def cp_capacity_rows(local: int, ratio: int) -> int:
    """Fixed per-rank capacity (entries) of the compressed buffer that is all-gathered.

    ``ceil_to(max(1, (local + d_comp) // ratio), 32 // gcd(32, ratio))``
    (Megatron ``csa_utils/cp_utils.py:235-240``); the gathered buffer holds cp × this.
    """
    need = max(1, (local + compress_width(ratio)) // ratio)
    align = 32 // gcd(32, ratio)
    return -(-need // align) * align


def csa_allgather_bytes(
    seq_len: int,
    *,
    kv_dim: int = 512,
    index_dim: int = 128,
    elem_bytes: int = BF16_BYTES,
    with_indexer: bool = True,
) -> int:
    """Bytes of gathered compressed state one CSA layer holds on every CP rank.

    ``(seq_len / 4) · (kv_dim + index_dim) · elem_bytes``: the main compressed KV (512) and the
    indexer keys (128), BF16. At 10**6 tokens: 250000 · 640 · 2 = 320e6 B ≈ 305 MiB (seed 000
    §5.5); at 2**20 tokens: 320 MiB. It does not shrink with CP. ``with_indexer=False`` (dense
    mode: no indexer is built) drops the index keys. Logical size; see ``cp_capacity_rows`` for
    the padded buffer.
    """
    width = kv_dim + (index_dim if with_indexer else 0)
    return compressed_entries(seq_len, CSA_RATIO) * width * elem_bytes


def hca_allgather_bytes(seq_len: int, *, kv_dim: int = 512, elem_bytes: int = BF16_BYTES) -> int:
    """Bytes of gathered compressed KV one HCA layer holds on every CP rank: (seq_len/128)·512·2."""
    return compressed_entries(seq_len, HCA_RATIO) * kv_dim * elem_bytes


def padded_allgather_bytes(seq_len: int, cp: int, ratio: int, width: int, elem_bytes: int = BF16_BYTES) -> int:
    """Bytes of the fixed-capacity gathered buffer: cp · cp_capacity_rows(seq_len//cp) · width · elem_bytes."""
    return cp * cp_capacity_rows(local_rows(seq_len, cp), ratio) * width * elem_bytes


def allgather_bytes_total(
    seq_len: int,
    ratios: Iterable[int],
    *,
    kv_dim: int = 512,
    index_dim: int = 128,
    with_indexer: bool = True,
) -> int:
    """Gathered compressed bytes summed over every layer in ``ratios`` (decoder and MTP), per CP rank."""
    total = 0
    for r in ratios:
        if r == CSA_RATIO:
            total += csa_allgather_bytes(seq_len, kv_dim=kv_dim, index_dim=index_dim, with_indexer=with_indexer)
        elif r == HCA_RATIO:
            total += hca_allgather_bytes(seq_len, kv_dim=kv_dim)
    return total


def topk_alignment(sm: int | None) -> int | None:
    """Top-k width alignment of the fused sparse kernels: 64 on SM100+, 128 below; None on CPU.

    Megatron ``csa_utils/fused_sparse_attention.py:111-122`` (``_get_topk_alignment``).
    """
    if sm is None:
        return None
    return 64 if sm >= 100 else 128


def topk_padding_waste(topk: int, sm: int | None) -> int:
    """Index slots (per query, per CSA layer) the kernel pads with -1: ceil_to(topk, align) − topk.

    0 on CPU targets (no fused kernel). Example: topk 1000 on SM90 pads to 1024, wasting 24.
    """
    align = topk_alignment(sm)
    if align is None:
        return 0
    return -(-topk // align) * align - topk


def visible_compressed_entries(seq_len: int, ratio: int = CSA_RATIO) -> int:
    """Compressed entries the last query of a sequence can see: (seq_len) // ratio (causal)."""
    return compressed_entries(seq_len, ratio)


def pp_stage_costs(layout: str, model, seq_len: int, phase: str = "sparse", indexer_loss: bool = True) -> list[float]:
    """Forward FLOPs per token of each virtual pipeline stage of ``layout`` (cost model: ``cost_model``).

    ``model`` is a ``ModelConfig``; ``phase`` the stage's attention phase; ``indexer_loss`` whether
    the indexer KL loss is on. Raises ``LayoutSyntaxError`` on a malformed layout.
    """
    from .cost_model import stage_costs, unit_costs
    from .layout import parse_layout

    return stage_costs(parse_layout(layout), unit_costs(model, seq_len, phase, indexer_loss))


GRAPH_FREE_REASONS = {
    "reference": "the reference attention reads per-chunk entry ranges on the host",
    "cudnn": "the cudnn kernels are not checked free of host synchronisation (only triton's are)",
}
"""Why a stage runs its step without a CUDA graph under ``compile.cuda_graph``; the job logs the same words."""


def graph_free_reason(backend: str) -> str | None:
    """Why a stage on kernel ``backend`` runs eagerly under ``compile.cuda_graph`` (None: its micro-batch step is
    captured and replayed), whatever its phase: on triton the warm-up's dense indexer KL reads nothing on the host
    in a captured step (``model/kernels/layer.static_chunks``; tests/training/test_cuda_graph_step.py's warm-up
    cases, eager and compiled, replay equal to the eager step on an H100, 2026-12-05). Shared by rule
    V4-CUDA-GRAPH, the memory plan and the job (``training/graph_step.py``). Raises KeyError on a backend outside
    ``GRAPH_FREE_REASONS`` and triton."""
    return None if backend == "triton" else GRAPH_FREE_REASONS[backend]
