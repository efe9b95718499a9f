"""Context parallelism over a ``torch.distributed`` group: the job-facing API.

Spec: seed 000 §5 (the V4 CP algorithm), §6 (contract), §11.2, §12 items 4 and 8;
megatron-v4-contract §1 B8/B13 (local rows >= boundary width, T % cp == 0) and §3
(boundary width, capacity). Upstream: Megatron ``csa_utils/cp_utils.py`` and
``datasets/data_schedule_utils.py`` (contiguous slicing). The boundary width and the
capacity come from ``v4launch.validators.derived`` so the validator and this runtime
share one definition.

Per batch and attention layer (see docs/context_parallel.md):

1. contiguous partition: rank r holds global rows r*L .. r*L+L-1 (L = T / cp);
2. the left neighbour's last ``B = boundary_width(window, ratios)`` attention-input rows
   arrive by P2P (:class:`comm.BoundaryExchange`); window KV and compressor inputs are
   computed on those B + L rows;
3. a compressed group belongs to the rank holding its LAST token; owned rows (main KV,
   and indexer keys on CSA layers, concatenated) fill a ``cp_capacity_rows(L, ratio)``
   buffer that is all-gathered rank-major (:class:`comm.AllGather`);
4. local queries keep their global segment positions (per-query causal offsets) and
   read entries by logical id, lowered to the physical row through ``plan.phys``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4launch.validators.derived import boundary_width, cp_capacity_rows

from ..packing import CompressPlan, EntryMemory, Pack, compress_plan, make_pack
from .base import ContextParallel, Shard
from .comm import AllGather, BoundaryExchange, Comm, SumPartial, Tie


def _rows(full: Pack, a: int, b: int) -> Pack:
    """Rows a .. b-1 of the global pack (rows < 0 are inert: segment 0, position 0)."""
    pad = max(0, -a)
    seg, pos = full.seg[max(a, 0):b], full.pos[max(a, 0):b]
    if pad:
        seg = torch.cat((seg.new_zeros(pad), seg))
        pos = torch.cat((pos.new_zeros(pad), pos))
    return Pack(cu=full.cu, lengths=full.lengths, seg=seg, pos=pos, n_tokens=b - a, max_seqlen=full.max_seqlen,
                cu_host=full.cu_host)


class ContextParallelGroup(ContextParallel):
    """V4 context parallelism over ``group`` (a ``torch.distributed`` process group; None = world).

    Pass it as ``V4Model(args, phase, cp=ContextParallelGroup(group))``; every rank of the
    group runs the model on its contiguous slice (see :func:`shard_thd_batch`). Losses come
    back as global means (replicated on every rank); parameter gradients must then be
    all-reduced with SUM over ``group`` (docs/context_parallel.md, "Contract for the job").

    Attributes:
        size, rank: CP size and this rank's index in ``group``.
        traffic: :class:`comm.Traffic` byte counter of every collective of this object.
    """

    def __init__(self, group=None) -> None:
        self.comm = Comm(group)
        self.size, self.rank, self.traffic = self.comm.size, self.comm.rank, self.comm.traffic

    def shard(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window_size: int,
              compress_ratios) -> Shard:
        """Build this rank's :class:`Shard`; tokens [L] are the local rows, cu_seqlens the GLOBAL table.

        Raises:
            ValueError: cu_seqlens[-1] != L * cp (not this rank's slice of a T = L*cp batch),
                L < the boundary width, or any ``make_pack`` error.
        """
        L, cp = int(tokens.numel()), self.size
        width = boundary_width(window_size, compress_ratios)
        if L < width:
            raise ValueError(f"context parallelism: local rows L={L} < boundary width {width} = "
                             f"max(window_size={window_size}, compressor context) (cp={cp}, T={L * cp}). "
                             f"Fix: pack at least {width * cp} tokens per micro-batch or lower cp.")
        T = int(cu_seqlens[-1]) if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.numel() else -1
        if T != L * cp:
            raise ValueError(f"context parallelism: cu_seqlens[-1]={T} but cp={cp} ranks x L={L} local rows = "
                             f"{L * cp}. Fix: pass the GLOBAL cu_seqlens and this rank's slice from "
                             "shard_thd_batch (T must be divisible by cp).")
        full = make_pack(tokens.new_zeros(()).expand(T), cu_seqlens, max_seqlen)
        start = self.rank * L
        return Shard(pack=_rows(full, start, start + L), ext=_rows(full, start - width, start + L),
                     left=width, start=start)

    def plan(self, shard: Shard, ratio: int) -> CompressPlan:
        """Global entry tables, this rank's owned entries (extended coordinates) and the
        logical -> physical map ``phys[e] = owner(e) * capacity + (e - first owned id of owner)``."""
        full = Pack(cu=shard.pack.cu, lengths=shard.pack.lengths, seg=shard.pack.seg.new_zeros(0),
                    pos=shard.pack.pos.new_zeros(0), n_tokens=0, max_seqlen=shard.pack.max_seqlen,
                    cu_host=shard.pack.cu_host)
        g = compress_plan(full, ratio)  # per-entry tables only need cu / lengths
        L = shard.pack.n_tokens
        owner = (g.start + ratio - 1) // L  # [C] rank holding each group's last token
        counts = torch.bincount(owner, minlength=self.size)
        cap = cp_capacity_rows(L, ratio)
        if g.n_entries and int(counts.max()) > cap:  # cannot happen: owned ends are >= ratio apart
            raise RuntimeError(f"CP capacity {cap} < {int(counts.max())} owned entries (L={L}, ratio={ratio})")
        first = torch.cumsum(counts, 0) - counts
        phys = owner * cap + torch.arange(g.n_entries, device=owner.device) - first[owner]
        own = owner == self.rank
        return CompressPlan(ratio=ratio, n_entries=g.n_entries, start=g.start[own] - (shard.start - shard.left),
                            pos=g.pos[own], has_prev=g.has_prev[own], seg_offset=g.seg_offset,
                            n_visible=(shard.ext.pos + 1) // ratio, max_entries=g.max_entries,
                            capacity=cap, phys=phys)

    def extend(self, x: torch.Tensor, shard: Shard) -> torch.Tensor:
        return BoundaryExchange.apply(x, shard.left, self.comm, "hidden")

    def gather(self, parts: list[torch.Tensor], plan: CompressPlan, shard: Shard, what: str) -> list[EntryMemory]:
        widths = [p.shape[1] for p in parts]
        own = torch.cat(parts, dim=1)  # [C_own, sum(widths)]
        pad = own.new_zeros(plan.capacity - own.shape[0], own.shape[1])  # never visible (phys skips them)
        buf = AllGather.apply(torch.cat((own, pad)), self.comm, what)  # [cp * capacity, sum(widths)]
        # the buffer holds the parts' promoted dtype (bf16 indexer keys beside a CSA first layer's float32
        # compressed KV: float32); each part leaves in its own (mixed, the KL student kernels refuse them)
        return [EntryMemory(b.to(p.dtype), plan.phys) for b, p in zip(buf.split(widths, dim=1), parts)]

    def tie(self, out: torch.Tensor, memories: list[EntryMemory]) -> torch.Tensor:
        for m in memories[:1]:  # the parts come from one gathered buffer (views, or copies in their own dtype)
            out = Tie.apply(out, m.buf)
        return out

    def next_first(self, x: torch.Tensor, fill: int) -> torch.Tensor | None:
        return self.comm.shift_left(x[:1], x[:1], "next_first", "mtp", "forward")

    def sum_partial(self, t: torch.Tensor) -> torch.Tensor:
        return SumPartial.apply(t, self.comm, "loss")

    def sum_counts(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(t, "counts")

    def sum_int(self, n: int) -> int:
        count = torch.tensor([n], dtype=torch.int64, device=self.comm.scalar_device)
        return int(self.comm.all_reduce(count, "counts").item())


@dataclass(frozen=True)
class LocalBatch:
    """One rank's slice of a packed batch (contiguous CP partition).

    tokens, labels: [L] rows ``start .. start + L - 1`` of the global tensors (labels
    already shifted globally by the job: ``labels[t] = tokens[t+1]`` inside a segment).
    cu_seqlens: the GLOBAL [N+1] table (pass it to the model unchanged). T: global rows.
    """

    tokens: torch.Tensor
    labels: torch.Tensor | None
    cu_seqlens: torch.Tensor
    start: int
    T: int


def shard_thd_batch(tokens: torch.Tensor, labels: torch.Tensor | None, cu_seqlens: torch.Tensor, cp_rank: int,
                    cp_size: int, boundary: int | None = None) -> LocalBatch:
    """Slice a packed THD batch for CP rank ``cp_rank`` of ``cp_size`` (contiguous partition).

    Args:
        tokens, labels: [T] global rows (labels may be None). cu_seqlens: [N+1] global.
        boundary: optional boundary width (``validators.derived.boundary_width(window, ratios)``)
            to check L >= boundary here rather than in the model's forward.
    Returns: :class:`LocalBatch` (views, no copy).
    Raises:
        ValueError: T % cp_size != 0, cp_rank outside [0, cp_size), or L < boundary.
        Source: Megatron ``datasets/data_schedule_utils.py:79-84`` (B13), ``cp_utils.py:135`` (B8).
    """
    T = int(tokens.numel())
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank}, cp_size={cp_size}: need 0 <= cp_rank < cp_size. "
                         "Fix: pass the rank's index inside its CP group.")
    if T % cp_size:
        raise ValueError(f"context parallelism: T={T} packed tokens is not divisible by cp={cp_size} "
                         f"(contiguous partition, equal rows per rank). Fix: pack T as a multiple of {cp_size}, "
                         f"e.g. pad the pack to {-(-T // cp_size) * cp_size} tokens with a filler segment.")
    L = T // cp_size
    if boundary is not None and L < boundary:
        raise ValueError(f"context parallelism: local rows L = T/cp = {T}/{cp_size} = {L} < boundary width "
                         f"{boundary}. Fix: pack at least {boundary * cp_size} tokens or lower cp.")
    rows = slice(cp_rank * L, (cp_rank + 1) * L)
    return LocalBatch(tokens=tokens[rows], labels=None if labels is None else labels[rows],
                      cu_seqlens=cu_seqlens, start=rows.start, T=T)
