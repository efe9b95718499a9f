"""Context-parallel (CP) interface of the model and its single-device default; the expert dispatcher default.

Spec: seed 000 §5 (contiguous partition, left boundary exchange, compressed ownership,
all-gather, logical -> physical lowering) and style "For v4launch" rule 2: math
modules never import ``torch.distributed``; they call the hooks of a
:class:`ContextParallel` passed as ``V4Model(..., cp=...)``. The default below does no
communication, so a single-device model is unchanged. The distributed implementation
is :class:`v4launch.model.parallel.group.ContextParallelGroup`.

Coordinates: a rank holds ``L`` contiguous rows of the packed batch starting at global
row ``start``. Attention sees ``left`` boundary rows in front of them (the "extended"
rows ``start - left .. start + L - 1``); query rows are the local ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..packing import CompressPlan, EntryMemory, Pack, compress_plan, make_pack


@dataclass(frozen=True)
class Shard:
    """This rank's view of one packed batch.

    Attributes:
        pack: the local rows (``seg`` / ``pos`` [L] use GLOBAL segment ids; ``cu`` /
            ``lengths`` are the global tables; ``n_tokens`` = L).
        ext: the extended rows (``left`` boundary rows + the L local rows) for attention.
        left: boundary rows in front of the local rows (0 on one device).
        start: global row of local row 0 (0 on one device).
    """

    pack: Pack
    ext: Pack
    left: int = 0
    start: int = 0


class ContextParallel:
    """Single-device default: no communication; every hook returns its input's identity.

    A CP implementation overrides every method (same signatures). Hooks that communicate
    must be called by every rank of the group in the same order, which the model
    guarantees by branching only on global quantities (entry counts, phases).
    """

    size: int = 1
    rank: int = 0

    def shard(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window_size: int,
              compress_ratios) -> Shard:
        """Validate the batch and build this rank's :class:`Shard`.

        tokens [L] are this rank's rows; cu_seqlens [N+1] are the GLOBAL boundaries.
        Raises ValueError on malformed input (see ``packing.make_pack``).
        """
        pack = make_pack(tokens, cu_seqlens, max_seqlen)
        return Shard(pack=pack, ext=pack)

    def plan(self, shard: Shard, ratio: int) -> CompressPlan:
        """Compressed entries of ``ratio``: global counts/visibility; ``start``/``pos``/``has_prev``
        list the entries THIS rank computes, with ``start`` in extended-row coordinates."""
        return compress_plan(shard.ext, ratio)

    def extend(self, x: torch.Tensor, shard: Shard) -> torch.Tensor:
        """Local rows [L, ...] -> extended rows [left + L, ...] (left boundary from the left neighbour)."""
        return x

    def gather(self, parts: list[torch.Tensor], plan: CompressPlan, shard: Shard, what: str) -> list[EntryMemory]:
        """This rank's entries, one tensor [C_own, d_i] per part (main KV, indexer keys) ->
        one :class:`EntryMemory` per part holding every entry, addressed by logical id.

        Under CP the parts travel in ONE fixed-capacity all-gather; ``what`` names it
        for the traffic counter (e.g. "layer_01").
        """
        return [EntryMemory(p) for p in parts]

    def tie(self, out: torch.Tensor, memories: list[EntryMemory]) -> torch.Tensor:
        """``out`` unchanged, made to depend on the gathered buffers (zero gradient), so the
        gather's backward runs on every rank even where no local query read an entry."""
        return out

    def next_first(self, x: torch.Tensor, fill: int) -> torch.Tensor | None:
        """The row after this rank's last row ([1], from the right neighbour); None means ``fill``."""
        return None

    def sum_partial(self, t: torch.Tensor) -> torch.Tensor:
        """0-d partial loss sum -> the sum over CP ranks (replicated). Backward: identity,
        so each rank's parameter gradients hold only its own rows' contributions."""
        return t

    def sum_counts(self, t: torch.Tensor) -> torch.Tensor:
        """Tensor of counts (no gradient) -> elementwise sum over CP ranks."""
        return t

    def sum_int(self, n: int) -> int:
        """Host integer -> sum over CP ranks."""
        return n


SINGLE_DEVICE = ContextParallel()
"""The shared no-op instance (the default of ``V4Model(cp=None)``)."""


class ExpertDispatch:
    """Routed-expert dispatcher of :class:`model.moe.MoE`; this default is the single-device identity.

    ``MoE`` sorts its T*K (token, expert) slots by expert id and hands the rows to
    :meth:`dispatch`; it runs its LOCAL experts (those left in ``MoE.experts``) on what comes
    back and hands their outputs to :meth:`combine`. An expert-parallel implementation
    (``model.parallel.expert.ExpertParallelDispatch``) overrides both with the same
    signatures; it must be called by every rank of its group in the same order.

    Attributes:
        ep: number of ranks the routed experts are spread over (1 here).
        ep_rank: this rank's index among them (0 here).
    """

    ep: int = 1
    ep_rank: int = 0

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Send each row to the rank holding its expert.

        Args:
            x_sorted: [N, dim] rows sorted by global expert id (N = T*K of this rank).
            counts: [E] int64, rows per global expert (``counts.sum() == N``).
        Returns:
            x_local [M, dim]: the rows for this rank's E/ep experts, grouped by local expert;
            local_counts [E/ep] int64: rows per local expert; ctx: what :meth:`combine` needs.
        """
        return x_sorted, counts, None

    def combine(self, y_local: torch.Tensor, ctx: object) -> torch.Tensor:
        """Expert outputs [M, dim] (order of ``dispatch``'s x_local) -> [N, dim] in x_sorted's order."""
        return y_local


SINGLE_DEVICE_EXPERTS = ExpertDispatch()
"""The shared no-op dispatcher (the default of every ``MoE``)."""
