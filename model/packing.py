"""THD packing helpers: segment tables, sliding windows, compressed-entry plans.

Spec: reference/v4-model-spec.md §2 ("Sliding window", "Incomplete tail",
"Causality") and seed 000 §4 (what must reset at a packed-sample boundary).
Upstream: ``get_window_topk_idxs`` and ``get_compress_topk_idxs`` in the released
``inference/model.py`` (single-sequence versions of the tables built here).

A batch is ``tokens`` [T] (no batch dim) with ``cu_seqlens`` [N+1] (0 = first,
T = last) and ``max_seqlen``. Everything positional is computed per segment:
positions restart at 0, windows and compressed entries never cross a boundary, and
a segment's tail shorter than the ratio produces no compressed entry.
All tables are index tensors built without Python loops over tokens.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch


def _bad(arg: str, value: object, rule: str, fix: str) -> ValueError:
    return ValueError(f"{arg}={value}: {rule}. Fix: {fix}.")


@dataclass(frozen=True)
class Pack:
    """Segment tables of one packed batch (all int64 tensors on the tokens' device).

    Attributes:
        cu: [N+1] segment starts, cu[0] = 0, cu[N] = T.
        lengths: [N] tokens per segment.
        seg: [T] segment id of each token.
        pos: [T] position of each token inside its segment (0-based).
        n_tokens: T.  max_seqlen: upper bound on any segment length (host int).
        cu_host: the same boundaries as host ints (None when not known), so that host-side
            sizes (entry counts) need no device synchronisation.
    """

    cu: torch.Tensor
    lengths: torch.Tensor
    seg: torch.Tensor
    pos: torch.Tensor
    n_tokens: int
    max_seqlen: int
    cu_host: tuple[int, ...] | None = None

    @property
    def n_segments(self) -> int:
        return self.lengths.numel()


def make_pack(tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> Pack:
    """Validate a THD batch and build its :class:`Pack`.

    The boundaries are read on the host once (free when ``cu_seqlens`` is a CPU tensor, the
    cheapest way to call the model; one device -> host copy otherwise), checked there, and copied
    to the tokens' device without waiting for it.

    Raises:
        ValueError: tokens not a 1-D integer tensor; cu_seqlens not 1-D integer, not
            starting at 0, not ending at T, not strictly increasing; max_seqlen smaller
            than the longest segment.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise _bad("tokens", shape, "must be a 1-D integer tensor [T] (THD layout, no batch dim)",
                   "flatten the packed batch and pass segment boundaries in cu_seqlens")
    T = tokens.numel()
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        desc = (cu_seqlens.dtype, tuple(cu_seqlens.shape)) if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
        raise _bad("cu_seqlens", desc, "must be a 1-D int32/int64 tensor [N+1]",
                   "pass cumulative segment lengths, e.g. tensor([0, 5, 12])")
    cu_host = tuple(cu_seqlens.tolist())
    if len(cu_host) < 2 or cu_host[0] != 0 or cu_host[-1] != T:
        raise _bad("cu_seqlens", list(cu_host), f"must start at 0 and end at T={T} with at least one segment",
                   "build it as [0, len_0, len_0 + len_1, ..., T]")
    if any(b <= a for a, b in zip(cu_host, cu_host[1:])):
        raise _bad("cu_seqlens", list(cu_host), "must be strictly increasing (no empty segment)",
                   "drop empty segments from the pack")
    longest = max(b - a for a, b in zip(cu_host, cu_host[1:]))
    # copied in its own dtype, then widened on the device: a dtype change on the host would copy from a fresh
    # pageable tensor instead of the (page-locked) one the data path hands over
    cu = cu_seqlens.to(device=tokens.device, non_blocking=True).to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    try:
        max_seqlen = operator.index(max_seqlen)
    except TypeError:
        pass
    if not isinstance(max_seqlen, int) or max_seqlen < longest:
        raise _bad("max_seqlen", max_seqlen, f"must be an int >= the longest segment ({longest})",
                   "pass max(cu_seqlens[1:] - cu_seqlens[:-1]) or the packing capacity")
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=T)
    pos = torch.arange(T, device=cu.device) - cu[seg]
    return Pack(cu=cu, lengths=lengths, seg=seg, pos=pos, n_tokens=T, max_seqlen=max_seqlen, cu_host=cu_host)


def check_ids(tokens: torch.Tensor, labels: torch.Tensor | None, vocab_size: int) -> None:
    """Raise ValueError unless tokens are in [0, vocab) and labels are [T] integers in [0, vocab) or -100.

    The range checks are reduced on the device and read back in ONE transfer (the forward's only
    host synchronisation besides reading ``cu_seqlens``; none for CPU tensors): an out-of-range id
    would otherwise fail later as an opaque device-side assert."""
    n_tokens = tokens.numel()
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != (n_tokens,)
                               or labels.is_floating_point()):
        desc = (labels.dtype, tuple(labels.shape)) if isinstance(labels, torch.Tensor) else labels
        raise _bad("labels", desc, f"must be an integer tensor of shape ({n_tokens},) like tokens",
                   "set labels[t] = tokens[t+1] inside a segment and -100 at each segment's last token and padding")
    if not n_tokens:
        return
    stats = [tokens.min(), tokens.max()]
    if labels is not None:
        bad = (labels != -100) & ((labels < 0) | (labels >= vocab_size))
        stats.append(bad.any())
    got = torch.stack([t.to(torch.int64) for t in stats]).tolist()
    if got[0] < 0 or got[1] >= vocab_size:
        raise _bad("tokens", f"range [{got[0]}, {got[1]}]", f"ids must be in [0, {vocab_size})",
                   "check the tokenizer against ModelArgs.vocab_size")
    if labels is not None and got[2]:
        value = int(labels[(labels != -100) & ((labels < 0) | (labels >= vocab_size))][0])
        raise _bad("labels", f"value {value}", f"must be -100 (ignore) or in [0, {vocab_size})",
                   "use -100 for ignored positions")


def window_table(pack: Pack, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window keys per query: query t sees tokens max(seg_start, t-window+1) .. t.

    Returns:
        idx: [T, W] token indices (W = min(window, max_seqlen)), oldest first; 0 where invalid.
        valid: [T, W] bool.
    """
    W = min(window, pack.max_seqlen)
    back = torch.arange(W - 1, -1, -1, device=pack.pos.device)  # distance from the query, [W]
    valid = back[None, :] <= pack.pos[:, None]  # [T, W]
    idx = torch.arange(pack.n_tokens, device=pack.pos.device)[:, None] - back[None, :]
    return idx.clamp_min(0) * valid, valid


@dataclass(frozen=True)
class CompressPlan:
    """Compressed entries of one ratio over a packed batch (global entry order = segment order).

    Attributes:
        ratio: 4 or 128.
        n_entries: C = sum over segments of floor(L_b / ratio) (incomplete tails dropped).
        start: [C] token index of the first token of each entry's (current) window.
        pos: [C] RoPE position of each entry inside its segment: i * ratio.
        has_prev: [C] whether entry i has a previous window in its segment (i >= 1).
        seg_offset: [N] global index of each segment's first entry.
        n_visible: [T] entries visible to each query: (pos + 1) // ratio.
        max_entries: host bound on entries of one segment: max_seqlen // ratio.
        capacity: context parallelism only: fixed rows per rank in the gathered buffer
            (0 on one device). phys: [C] logical entry id -> physical (rank-major) row, or None.
    """

    ratio: int
    n_entries: int
    start: torch.Tensor
    pos: torch.Tensor
    has_prev: torch.Tensor
    seg_offset: torch.Tensor
    n_visible: torch.Tensor
    max_entries: int
    capacity: int = 0
    phys: torch.Tensor | None = None


def pad_pack(pack: Pack, n_segments: int, max_seqlen: int) -> Pack:
    """``pack`` with batch-independent shapes, for a step captured once in a CUDA graph and replayed on new batches.

    The segment tables grow to ``n_segments`` entries (the real segments, then empty ones that start and end
    at T: ``lengths`` 0, no token belongs to them) and ``max_seqlen`` becomes the static bound (host ints
    that size tables must not change between replays). Everything a token reads (``seg``, ``pos``) is
    unchanged, so the model's outputs are the same (tests/model/test_static_batch.py). ``cu_host`` is
    dropped: host sizes come from the bounds (:func:`compress_plan` with ``entries``).

    Raises:
        ValueError: ``n_segments`` below the real segment count or ``max_seqlen`` below the pack's bound.
    """
    n = pack.n_segments
    if n_segments < n or max_seqlen < pack.max_seqlen:
        raise _bad("static shape", f"({n_segments} segments, max_seqlen {max_seqlen})",
                   f"must hold the batch ({n} segments, max_seqlen {pack.max_seqlen})",
                   "size the static batch from the stage's tokens per micro-batch and seq_len")
    cu = torch.cat((pack.cu, pack.cu.new_full((n_segments - n,), pack.n_tokens)))
    return Pack(cu=cu, lengths=cu[1:] - cu[:-1], seg=pack.seg, pos=pack.pos, n_tokens=pack.n_tokens,
                max_seqlen=max_seqlen, cu_host=None)


def compress_plan(pack: Pack, ratio: int, entries: int | None = None) -> CompressPlan:
    """Build the :class:`CompressPlan` of ``ratio`` for ``pack`` (vectorised over entries).

    ``entries``: a static entry count C (>= the real one; ``T // ratio`` always holds a batch of T tokens)
    for a batch of :func:`pad_pack`. Entries past the real ones start at token 0 with position 0 and no
    previous window: the compressor computes them, and no query sees them (``n_visible`` and ``seg_offset``
    reach only real entries). No host synchronisation either way (without ``entries`` the count is a sum over
    ``cu_host``; read from the device only for a pack without host boundaries).
    """
    counts = pack.lengths // ratio  # [N]
    if entries is not None:
        C = entries
    elif pack.cu_host is not None:  # host boundaries: no device synchronisation for the entry count
        C = sum((b - a) // ratio for a, b in zip(pack.cu_host, pack.cu_host[1:]))
    else:
        C = int(counts.sum())
    ends = torch.cumsum(counts, 0)
    seg_offset = ends - counts
    e = torch.arange(C, device=counts.device)
    entry_seg = torch.searchsorted(ends, e, right=True).clamp_max(counts.numel() - 1)  # segments in entry order
    i = e - seg_offset[entry_seg]  # index inside the segment
    real = e < ends[-1]  # all of them without ``entries``
    zero = torch.zeros_like(e)
    return CompressPlan(ratio=ratio, n_entries=C, start=torch.where(real, pack.cu[entry_seg] + i * ratio, zero),
                        pos=torch.where(real, i * ratio, zero), has_prev=real & (i > 0), seg_offset=seg_offset,
                        n_visible=(pack.pos + 1) // ratio, max_entries=pack.max_seqlen // ratio)


def visible_table(pack: Pack, plan: CompressPlan, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All compressed entries visible to each query (entry i iff i < (pos+1)//ratio).

    Returns:
        idx: [R, P] global entry indices (P = plan.max_entries), 0 where invalid.
        valid: [R, P] bool. R = T, or the rows selected by ``rows``.
    """
    rows = rows or slice(None)
    j = torch.arange(plan.max_entries, device=pack.pos.device)
    valid = j[None, :] < plan.n_visible[rows, None]
    idx = plan.seg_offset[pack.seg[rows]][:, None] + j[None, :]
    return idx * valid, valid


def entry_range(pack: Pack, plan: CompressPlan, rows: slice) -> tuple[int, int]:
    """Global entry ids [lo, hi) that any query in the contiguous ``rows`` may see (host ints)."""
    first, last = rows.start, rows.stop - 1
    lo = int(plan.seg_offset[pack.seg[first]])
    hi = int(plan.seg_offset[pack.seg[last]] + plan.n_visible[last])
    return lo, max(lo, hi)


def shift_in_segment(x: torch.Tensor, pack: Pack, fill: int, after: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = x[t+1] if t+1 is in t's segment, else ``fill``. [T] -> [T].

    Used for the MTP inputs and targets (spec §3 "MTP"): depth k applies it k times.
    ``after`` [1] is the value of the row after the last one (a context-parallel rank
    passes its right neighbour's first row; default ``fill``). Rows are last of their
    segment when ``pos + 1 == lengths[seg]``, so ``pack`` may be one rank's rows.
    """
    nxt = torch.cat((x[1:], x.new_full((1,), fill) if after is None else after.to(x.dtype)))
    last = pack.pos + 1 == pack.lengths[pack.seg]
    return torch.where(last, torch.full_like(x, fill), nxt)


@dataclass(frozen=True)
class EntryMemory:
    """Compressed entries addressed by LOGICAL id (global, sequence-major: segment order, then i).

    ``buf`` holds the rows: on one device ``[C, d]`` in logical order (``phys`` is None);
    under context parallelism the rank-major gathered buffer ``[cp * capacity, d]`` and
    ``phys`` [C] int64 maps each logical id to its physical row (seed 000 §5.2, §12 item 4).
    """

    buf: torch.Tensor
    phys: torch.Tensor | None = None

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Entries with logical ids lo .. hi-1: [hi - lo, d]."""
        return self.buf[lo:hi] if self.phys is None else self.buf[self.phys[lo:hi]]

    def at(self, idx: torch.Tensor) -> torch.Tensor:
        """Entries at logical ids ``idx`` [...] (lowered to physical rows): [..., d]."""
        return self.buf[idx] if self.phys is None else self.buf[self.phys[idx]]
