"""Lightning indexer of CSA layers: scores, top-k selection and the KL distillation loss.

Spec: reference/v4-model-spec.md §2 "Indexer (CSA layers only)"; seed 000 §2 (three
phase modes) and §3 (gradient ownership); seed 004 items 5, 6a, 6b, 6e and 11.
Upstream: ``Indexer`` in the released ``inference/model.py``; the KL objective
follows DeepSeek-V3.2 §2.1 (the V4 report does not specify it).

Score: ``I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s])`` with
``w = weights_proj(x) * index_n_heads**-0.5 * index_head_dim**-0.5``.
Queries come from the main query latent ``qr`` (after ``q_norm``); keys from the
indexer's own ratio-4 compressor. Both get RoPE (layer frequencies; queries at their
positions, keys at 4i) and, with ``use_hadamard``, the normalised Hadamard rotation.
The indexer sees ``x`` and ``qr`` DETACHED: its loss never reaches the backbone.
Never builds [T, H, P] for all queries at once; callers pass query chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .args import ModelArgs
from .common import acc_dtype, linear
from .compressor import Compressor, hadamard_rotate
from .packing import CompressPlan, EntryMemory
from .rope import RotaryEmbedding, apply_rope


@dataclass
class IndexerInputs:
    """Per-forward indexer tensors. q: [T, H_I, d_I]; w: [T, H_I] (temperature folded in);
    keys: [C_own, d_I] from :meth:`Indexer.prepare`, replaced by the caller with an
    :class:`EntryMemory` of every entry (by logical id) before scoring. All carry
    gradients to indexer parameters only."""

    q: torch.Tensor
    w: torch.Tensor
    keys: "torch.Tensor | EntryMemory"
    _chunks: tuple = ()

    def split_rows(self, chunk_size: int) -> None:
        """Split q and w once into chunks of ``chunk_size`` query rows for :meth:`at_rows`."""
        self._chunks = (chunk_size, self.q.split(chunk_size), self.w.split(chunk_size))

    def at_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [R, H_I, d_I], w [R, H_I]) of local query rows ``rows``.

        Rows of one chunk of :meth:`split_rows` come from that split: the gradients of all
        chunks are joined once, where a slice per chunk would zero-fill a whole [T, ...]
        gradient per chunk (O(T^2 / chunk) memory traffic). Other rows are sliced.
        """
        if self._chunks:
            size, q_chunks, w_chunks = self._chunks
            i = rows.start // size
            if rows.start % size == 0 and i < len(q_chunks) and rows.stop - rows.start == q_chunks[i].shape[0]:
                return q_chunks[i], w_chunks[i]
        return self.q[rows], self.w[rows]


class Indexer(nn.Module):
    """Lightning indexer. Parameters (released names): ``wq_b.weight`` [H_I*d_I, q_lora_rank],
    ``weights_proj.weight`` [H_I, dim], ``compressor.*`` (ratio 4, head_dim d_I, rotated)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.topk, self.use_hadamard = args.index_topk, args.use_hadamard
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        self.compressor = Compressor(args.dim, self.head_dim, 4, args.norm_eps, rotate=args.use_hadamard)

    @property
    def weight_scale(self) -> float:
        """Head-weight temperature ``index_n_heads**-0.5 * index_head_dim**-0.5`` (seed 004 item 6a)."""
        return self.n_heads ** -0.5 * self.head_dim ** -0.5

    def prepare(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, plan: CompressPlan,
                rope: RotaryEmbedding, x_comp: torch.Tensor | None = None) -> IndexerInputs:
        """Queries, head weights and keys. x [T, dim], qr [T, q_lora_rank] are detached here.

        ``x_comp``: compressor input (the extended rows under context parallelism; default
        ``x``), also detached; ``plan`` lists the entries to compute from it.
        Returns q [T, H_I, d_I] and keys [C, d_I] in one dtype (q's: bf16 under bf16 autocast), w [T, H_I] in
        the accumulation dtype.
        """
        x_comp = (x if x_comp is None else x_comp).detach()
        x, qr = x.detach(), qr.detach()
        q = linear(qr, self.wq_b).unflatten(-1, (self.n_heads, self.head_dim))  # [T, H_I, d_I]
        cos, sin = rope.cos_sin(positions, x.dtype)
        q = apply_rope(q, cos, sin)
        if self.use_hadamard:
            q = hadamard_rotate(q)
        w = linear(x, self.weights_proj, acc_dtype(x.dtype)) * self.weight_scale  # [T, H_I]
        # keys in the queries' dtype: under bf16 autocast q is bf16 but the compressor returns its input's dtype
        # (float32 at a CSA first layer, whose input is the float32 embedding), and one float32 operand sent the
        # student kernels to float32 math on the CUDA cores (~1.3 s of one backward call at Flash width, 64K
        # tokens; seed 000 §9: the indexer's activation path is bf16, its softmax / KL reductions float32)
        keys = self.compressor(x_comp, plan, rope).to(q.dtype)
        return IndexerInputs(q=q, w=w, keys=keys)

    @staticmethod
    def score_all(inp: IndexerInputs, rows: slice, lo: int, hi: int) -> torch.Tensor:
        """Scores of the query rows (local) against logical entries lo..hi-1: [R, hi - lo] (accumulation dtype)."""
        acc = acc_dtype(inp.q.dtype)
        q, w = inp.at_rows(rows)
        logits = torch.einsum("rhd,cd->rhc", q.to(acc), inp.keys.rows(lo, hi).to(acc))  # [R, H_I, Nc]
        return torch.einsum("rhc,rh->rc", logits.relu(), w)

    @staticmethod
    def score_at(inp: IndexerInputs, rows: slice, idx: torch.Tensor) -> torch.Tensor:
        """Scores at given entries: idx [R, K] global logical entry ids -> [R, K] (accumulation dtype)."""
        acc = acc_dtype(inp.q.dtype)
        keys = inp.keys.at(idx).to(acc)  # [R, K, d_I]
        q, w = inp.at_rows(rows)
        logits = torch.einsum("rhd,rkd->rhk", q.to(acc), keys)  # [R, H_I, K]
        return torch.einsum("rhk,rh->rk", logits.relu(), w)


def select_topk(inp: IndexerInputs, vis_idx: torch.Tensor, vis_valid: torch.Tensor, rows: slice,
                topk: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k visible entries per query row (no gradient: selection is discrete).

    Args:
        vis_idx, vis_valid: [R, P] visible entries of the rows, ids relative to ``lo``;
            every valid id lies in [0, hi - lo) (``packing.entry_range``).
    Returns:
        sel_idx [R, k] entry ids relative to ``lo`` (0 where invalid), sel_valid [R, k] bool, with
        k = min(topk, P); a query with fewer than k visible entries gets invalid slots.
    """
    k = min(topk, vis_idx.shape[1])
    with torch.no_grad():
        scores = Indexer.score_all(inp, rows, lo, hi).gather(1, vis_idx)  # [R, P]
        scores = scores.masked_fill(~vis_valid, float("-inf"))
        top = scores.topk(k, dim=1).indices  # [R, k] positions in the visible list
    sel_valid = vis_valid.gather(1, top)
    return vis_idx.gather(1, top) * sel_valid, sel_valid


def kl_teacher_student(teacher_logits: torch.Tensor, student: torch.Tensor,
                       valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of KL(p_teacher || p_indexer) over a candidate set.

    Args:
        teacher_logits: [R, H, K] main-attention logits (already scaled) at the candidates;
            detached here. The teacher is the per-head softmax over the candidates,
            averaged over heads (the head-summed distribution, renormalised).
        student: [R, K] indexer scores at the same candidates (with gradient).
        valid: [R, K] candidate mask; rows without a valid candidate count 0 (and get no gradient).
    Returns:
        (sum of per-row KL, number of rows counted as a 0-d int64 tensor on the device: no host
        synchronisation).
    """
    has = valid.any(dim=1, keepdim=True)  # [R, 1]
    teacher_logits = teacher_logits.detach().masked_fill(~valid[:, None, :], float("-inf"))
    teacher_logits = teacher_logits.masked_fill(~has[:, :, None], 0.0)  # rows without candidates: finite
    p_t = torch.where(valid, teacher_logits.softmax(dim=-1).mean(dim=1), 0.0)  # [R, K]
    return kl_from_teacher_probs(p_t, student, valid)


def kl_from_teacher_probs(p_t: torch.Tensor, student: torch.Tensor,
                          valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of KL(p_t || softmax(student over the valid slots)); rows without a valid slot count 0.

    p_t [R, K] teacher probabilities (0 at invalid slots), student [R, K], valid [R, K] bool ->
    (0-d KL sum in student's dtype, 0-d int64 count of rows with a valid slot). Masked, never
    indexed by the mask, so nothing waits for the device.
    """
    has = valid.any(dim=1, keepdim=True)  # [R, 1]
    # rows with some valid slot: -inf at the others; rows with none: zeros, so log_softmax stays finite
    scores = torch.where(valid, student, torch.where(has, float("-inf"), 0.0))
    log_p_s = scores.log_softmax(dim=-1).masked_fill(~valid, 0.0)
    p_t = torch.where(valid, p_t.to(student.dtype), 0.0)
    kl = torch.special.xlogy(p_t, p_t) - p_t * log_p_s  # [R, K]
    return kl.sum(), has.sum()
