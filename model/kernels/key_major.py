"""Work plan of the key-major backward for range candidates (no Triton: CPU-testable).

A query's range candidates (its sliding window over token rows; for HCA and dense-mode
CSA every visible compressed entry) are one contiguous kv row range per kind, with both
bounds non-decreasing in the query index t (segments are packed in order and a window or
visible prefix only moves forward). Then the queries whose range meets a block of kv rows
are contiguous too, and the backward can loop over them per block (key-major) instead of
scattering every (query, candidate) tile with atomics. Used by
``triton_attention.attention_bwd``; math: seed 000 §2 (candidate sets).
"""

from __future__ import annotations

from typing import Optional

import torch


def key_major_plan(ranges: torch.Tensor, n_rows: int, block: int, n_sm: int) -> Optional[list]:
    """Work list of ``triton_attention._range_dkv`` for the per-query row ranges ``ranges`` [T, 4] int32
    (a query's candidates: rows ``ranges[t, 0]..ranges[t, 1]-1`` and ``ranges[t, 2]..ranges[t, 3]-1``).

    For each range pair r (0: columns 0:2, 1: columns 2:4) that is non-empty for some query:
    ``(r, first_row, QS, QE, splits, qchunk)`` with blocks of ``block`` kv rows starting at
    ``first_row``, QS/QE [blocks] int32 the queries whose range meets each block, and the
    query range cut into ``qchunk``-query pieces (``splits`` programs per block at most) so
    that about 4 programs per SM share the work. Returns None when a range bound decreases
    somewhere in t (then the queries of a block are not contiguous and the backward
    scatters instead). Two host syncs.
    """
    T = ranges.shape[0]
    if T == 0:
        return []
    lo, hi = ranges[:, 0::2].long(), ranges[:, 1::2].long()  # [T, 2]
    mono = ((lo[1:] >= lo[:-1]) & (hi[1:] >= hi[:-1])).all(0) if T > 1 else torch.ones(2, dtype=torch.bool, device=lo.device)
    nonempty = (hi > lo).any(0)
    head = torch.stack((mono.long(), nonempty.long(), lo[0], hi[-1])).tolist()  # one sync
    if not all(head[0]):
        return None
    work, stats = [], []
    for r in (0, 1):
        if not head[1][r]:
            continue
        first, last = max(0, head[2][r]), min(n_rows, head[3][r])
        n0 = torch.arange(first, max(first, last), block, device=ranges.device)
        qs = torch.searchsorted(hi[:, r].contiguous(), n0, right=True)  # first t with hi > n0
        qe = torch.searchsorted(lo[:, r].contiguous(), n0 + block, right=False)  # first t with lo >= n1
        qe = torch.maximum(qe, qs)
        work.append([r, first, qs.to(torch.int32), qe.to(torch.int32)])
        stats.append(torch.stack(((qe - qs).max(), (qe - qs).sum())) if n0.numel() else torch.zeros(2, dtype=torch.long, device=ranges.device))
    if not work:
        return []
    for w, (most, total) in zip(work, torch.stack(stats).tolist()):  # one sync
        qchunk = max(64, -(-total // (4 * n_sm)))
        w += [-(-most // qchunk), qchunk]
    return [w for w in work if w[4] > 0]
