"""Plain-PyTorch versions of the attention kernels and of the head cross entropy's row passes
(any device, any float dtype).

They define the contract the Triton kernels must meet and are the fallback of
:func:`v4launch.model.kernels.dispatch.select_backend` off SM90. Semantics follow
``model/attention.py`` (``sink_softmax`` + the V = K sums) and ``model/indexer.py``
(``Indexer.score_all`` / ``select_topk`` / ``kl_teacher_student``).

Candidate sets. Query ``t`` attends over the rows of ``kv`` named by
``idx[t, :]`` (int32, ``-1`` = masked) plus, when ``ranges`` is given, the two
contiguous row ranges ``ranges[t, 0]:ranges[t, 1]`` and ``ranges[t, 2]:ranges[t, 3]``
(used for the sliding window and for "every visible compressed entry", so neither
needs a [T, window] / [T, entries] index table). A row must not appear twice in
one query's candidate set.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common import acc_dtype


def _candidates(idx: Optional[torch.Tensor], ranges: Optional[torch.Tensor], r0: int, r1: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows r0..r1-1: (kv row ids [R, K] with 0 where masked, valid [R, K])."""
    cols, valid = [], []
    if ranges is not None:
        rng = ranges[r0:r1].long()
        for a in (0, 2):
            lo, hi = rng[:, a], rng[:, a + 1]
            width = int((hi - lo).clamp_min(0).max()) if hi.numel() else 0
            if width:
                j = lo[:, None] + torch.arange(width, device=rng.device)[None, :]
                ok = j < hi[:, None]
                cols.append(j * ok)
                valid.append(ok)
    if idx is not None and idx.shape[1]:
        sel = idx[r0:r1].long()
        ok = sel >= 0
        cols.append(sel * ok)
        valid.append(ok)
    if not cols:
        z = torch.zeros(r1 - r0, 0, dtype=torch.long, device=(idx if idx is not None else ranges).device)
        return z, z.bool()
    return torch.cat(cols, 1), torch.cat(valid, 1)


def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, idx: Optional[torch.Tensor], sink: torch.Tensor,
                          scale: float, ranges: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA attention with a sink: q [T, H, D], kv [N, D] (K = V), idx [T, K] int32
    (-1 = masked) or None, sink [H], optional ranges [T, 4] int32.

    Returns ``out`` [T, H, D] (q's dtype) and ``lse`` [T, H] float32 (float64 for float64
    input) with ``lse = log(sum_c exp(scale * q.kv_c) + exp(sink))``, so that
    ``p_c = exp(scale * q.kv_c - lse)``. Differentiable in q, kv and sink (autograd).
    Computed in the accumulation dtype, in query chunks (memory O(chunk * K * D)).
    """
    T, H, D = q.shape
    acc = acc_dtype(q.dtype)
    width = (idx.shape[1] if idx is not None else 0) + (
        int((ranges[:, 1] - ranges[:, 0]).clamp_min(0).max() + (ranges[:, 3] - ranges[:, 2]).clamp_min(0).max())
        if ranges is not None and T else 0)
    chunk = max(1, min(256, 2 ** 25 // max(1, width * D)))
    s = sink.to(acc)[None, :, None]
    outs, lses = [], []
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        rows, valid = _candidates(idx, ranges, r0, r1)
        keys = kv[rows].to(acc)  # [R, K, D]
        logits = torch.einsum("rhd,rkd->rhk", q[r0:r1].to(acc), keys) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(-1, keepdim=True), s).detach() if logits.shape[-1] else s.expand(r1 - r0, H, 1)
        e = (logits - m).exp()
        den = e.sum(-1, keepdim=True) + (s - m).exp()
        outs.append(torch.einsum("rhk,rkd->rhd", e / den, keys))
        lses.append((m + den.log()).squeeze(-1))
    if not outs:
        return q.new_zeros(q.shape), torch.zeros(0, H, dtype=acc, device=q.device)
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def range_selection(lo: torch.Tensor, n_visible: torch.Tensor, width: int) -> torch.Tensor:
    """A selection table [T, width] int32 for per-row ranges: row t's slot j is ``lo[t] + j`` for
    j < ``n_visible[t]``, -1 after (lo, n_visible [T] integer; ``width`` >= the largest ``n_visible``)."""
    j = torch.arange(width, device=lo.device)
    return torch.where(j[None, :] < n_visible[:, None], lo[:, None].long() + j[None, :], -1).to(torch.int32)


def head_avg_probs(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """KL teacher over a selected set: per-head softmax of ``scale * q.kv`` over the valid
    slots of ``idx`` [T, K] (no sink), averaged over heads -> [T, K] float32/64, 0 where
    masked (rows without a valid slot are all 0). No gradient."""
    T, H, D = q.shape
    acc = acc_dtype(q.dtype)
    out = torch.zeros(T, idx.shape[1], dtype=acc, device=q.device)
    chunk = max(1, min(256, 2 ** 25 // max(1, idx.shape[1] * D)))
    with torch.no_grad():
        for r0 in range(0, T, chunk):
            r1 = min(T, r0 + chunk)
            sel = idx[r0:r1].long()
            ok = sel >= 0
            logits = torch.einsum("rhd,rkd->rhk", q[r0:r1].to(acc), kv[sel * ok].to(acc)) * scale
            logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
            p = logits.softmax(-1).nan_to_num(0.0).mean(1)
            out[r0:r1] = p * ok
    return out


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, first: torch.Tensor,
                   n_visible: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Indexer scores of query rows against entries lo..hi-1: q [R, HI, dI], w [R, HI],
    keys [C, dI], first/n_visible [R] (row r sees entries first[r] .. first[r]+n_visible[r]-1)
    -> [R, hi - lo] float, ``-inf`` where not visible. ``sum_h w * relu(q_h . k)``."""
    acc = acc_dtype(q.dtype)
    logits = torch.einsum("rhd,cd->rhc", q.to(acc), keys[lo:hi].to(acc))
    s = torch.einsum("rhc,rh->rc", logits.relu(), w.to(acc))
    c = torch.arange(lo, hi, device=q.device)[None, :]
    ok = (c >= first[:, None]) & (c < (first + n_visible)[:, None])
    return s.masked_fill(~ok, float("-inf"))


def indexer_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, first: torch.Tensor,
                 n_visible: torch.Tensor, topk: int, max_entries: int,
                 score_fn=indexer_scores) -> torch.Tensor:
    """Top-k visible compressed entries per query (no gradient).

    q [T, HI, dI], w [T, HI] (temperature folded in), keys [C, dI]; first [T] global id of
    the row's segment's first entry, n_visible [T] entries the row sees; ``max_entries``
    bounds n_visible. Returns idx [T, k] int32 global entry ids, ``-1`` where the row has
    fewer than k visible entries, with k = min(topk, max_entries) (as ``select_topk``).
    Processes query rows in chunks so the score block stays <= ~512 MiB.
    """
    T = q.shape[0]
    k = min(topk, max_entries)
    out = torch.full((T, k), -1, dtype=torch.int32, device=q.device)
    if T == 0 or k == 0:
        return out
    end = (first + n_visible).long()
    with torch.no_grad():
        rows_per = max(64, min(T, 2 ** 27 // max(1, max_entries)))
        for r0 in range(0, T, rows_per):
            r1 = min(T, r0 + rows_per)
            if r1 - r0 == T and T * keys.shape[0] <= 2 ** 27:  # one chunk of every key: no host read
                lo, hi = 0, keys.shape[0]
            else:  # the chunk's entry range, read on the host (a synchronisation per chunk on a GPU)
                lo = int(first[r0])
                hi = max(lo, int(end[r0:r1].max()))
            if hi == lo:
                continue
            s = score_fn(q[r0:r1], w[r0:r1], keys, first[r0:r1], n_visible[r0:r1], lo, hi)
            kk = min(k, hi - lo)
            val, pos = s.topk(kk, dim=1, sorted=False)
            out[r0:r1, :kk] = torch.where(torch.isfinite(val), pos + lo, -1).to(torch.int32)
    return out


def _score_at(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Indexer scores at selected entries: q [R, HI, dI], w [R, HI], keys [C, dI], sel [R, K] (-1 ok)."""
    acc = acc_dtype(q.dtype)  # float32 like Indexer.score_at: the KL gradient (p_s - p_t) is sensitive to it
    logits = torch.einsum("rhd,rkd->rhk", q.to(acc), keys[sel.clamp_min(0).long()].to(acc))
    return torch.einsum("rhk,rh->rk", logits.relu(), w.to(acc))


class _StudentScores(torch.autograd.Function):
    """Student scores at the selection, in chunks of ``ROWS`` query rows; the backward recomputes
    each chunk's logits (O(chunk · K · dI) memory) and scatters the key gradient with
    ``index_add_`` (atomic; torch's deterministic mode makes it sort-based), not the sort-based
    index backward of ``keys[sel]`` (41% of a 64K CSA step)."""

    ROWS = 2048

    @staticmethod
    def forward(ctx, q, w, keys, sel):
        T, K = sel.shape
        out = torch.empty(T, K, dtype=acc_dtype(q.dtype), device=q.device)
        for r0 in range(0, T, _StudentScores.ROWS):
            r1 = min(T, r0 + _StudentScores.ROWS)
            out[r0:r1] = _score_at(q[r0:r1], w[r0:r1], keys, sel[r0:r1])
        ctx.save_for_backward(q, w, keys, sel)
        return out

    @staticmethod
    def backward(ctx, g):
        q, w, keys, sel = ctx.saved_tensors
        acc = acc_dtype(q.dtype)
        dq, dw = torch.empty_like(q), torch.empty_like(w)
        dkeys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        for r0 in range(0, sel.shape[0], _StudentScores.ROWS):
            r1 = min(sel.shape[0], r0 + _StudentScores.ROWS)
            s_idx = sel[r0:r1].clamp_min(0).long()
            ok = (sel[r0:r1] >= 0).to(acc)
            qc, wc, gc = q[r0:r1].to(acc), w[r0:r1].to(acc), g[r0:r1].to(acc) * ok  # [R,HI,dI], [R,HI], [R,K]
            kg = keys[s_idx].to(acc)  # [R, K, dI]
            logits = torch.einsum("rhd,rkd->rhk", qc, kg)
            dw[r0:r1] = torch.einsum("rhk,rk->rh", logits.relu(), gc).to(w.dtype)
            gl = (logits > 0).to(acc) * wc[:, :, None] * gc[:, None, :]  # [R, HI, K]
            dq[r0:r1] = torch.einsum("rhk,rkd->rhd", gl, kg).to(q.dtype)
            dkeys.index_add_(0, s_idx.flatten(), torch.einsum("rhk,rhd->rkd", gl, qc).flatten(0, 1))
        return dq, dw, dkeys.to(keys.dtype), None


def student_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """Sparse-phase KL student: the indexer's scores at its own selection,
    ``s[t, k] = sum_h w[t, h] * relu(q[t, h] . keys[sel[t, k]])`` (``Indexer.score_at``).

    q [T, HI, dI], w [T, HI] (temperature folded in), keys [C, dI], sel [T, K] int global entry ids
    (``-1`` = masked: the slot's score is that of entry 0 and its gradient is zero; the KL ignores
    it) -> [T, K] float32 (float64 for float64 inputs). Differentiable in q, w and keys; computed in
    float32 whatever the inputs' dtype (the KL gradient ``p_s - p_t`` is sensitive to it).
    """
    return _StudentScores.apply(q, w, keys, sel)


def logsumexp_target(z: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-sum-exp and cross entropy of a head logits chunk (``loss.head_cross_entropy``'s forward).

    z [R, V] float (float32, float64 for a float64 model), labels [R] int64 in [0, V) or -100 (ignored)
    -> (lse [R], loss [R] = ``lse - z[r, label[r]]``, 0 on ignored rows), both in z's dtype.
    Math: the softmax cross entropy (as ``F.cross_entropy``, reduction none).
    """
    valid = labels != -100
    lse = torch.logsumexp(z, dim=-1)
    target = z.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    return lse, torch.where(valid, lse - target, 0.0)


def softmax_grad(z: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Gradient of the summed cross entropy in the logits, ``scale[r] * (softmax(z[r]) - onehot(label[r]))``.

    z [R, V], lse [R] (from :func:`logsumexp_target`), labels [R] (-100: ignored, its ``scale`` must be 0),
    scale [R] per-row factor -> dz [R, V] in ``out_dtype`` (the GEMM operand dtype).
    """
    dz = torch.exp(z - lse[:, None])
    dz.scatter_add_(1, torch.where(labels != -100, labels, 0)[:, None], -torch.ones_like(dz[:, :1]))
    return (dz * scale.to(z.dtype)[:, None]).to(out_dtype)
