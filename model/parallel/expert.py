"""Expert parallelism (EP): each rank of an EP group holds E/ep routed experts; rows travel by all-to-all.

Spec: docs/parallelism.md "Expert parallel"; DeepSeek-V3 report §3.2 (EP all-to-all
dispatch/combine). Upstream idea: torchtitan ``ExpertParallel`` (counts exchanged first,
then rows with ``all_to_all_single_autograd``, then a rank-major -> expert-major permute) —
reimplemented, not copied.

EP rank ``r`` holds global experts ``r*E/ep .. (r+1)*E/ep - 1``. Per MoE forward:

1. ``counts`` [E] (this rank's rows per global expert) is viewed as the [ep, E/ep] table
   ``send[r, j]`` = rows for expert j of rank r; one all-to-all of that table gives
   ``recv[r, j]`` = rows rank r sends for MY local expert j.
2. One host sync reads the split sizes (row sums of both tables); the rows, sorted by
   expert and so already grouped by destination rank, go in one autograd-aware
   all-to-all. The received rows are rank-major (rank, expert); a gather makes them
   expert-major (expert, rank) for the grouped GEMM, ``local_counts = recv.sum(0)``.
3. ``combine`` undoes the gather and sends the outputs back with the split sizes swapped.
   The backward of each all-to-all is the reverse all-to-all, so expert weights collect
   the gradient of every rank's tokens, and each rank's inputs get their own rows' gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from .. import fp8_experts
from ..moe import MoE
from .base import ExpertDispatch


@dataclass(frozen=True)
class _Exchange:
    """What ``combine`` needs of one ``dispatch``: split sizes (rows per rank) and the inverse gather.

    send_splits[r]: rows this rank sent to rank r; recv_splits[r]: rows it received from r;
    to_rank_major [M]: for each received row in rank-major order, its expert-major position.
    """

    send_splits: list[int]
    recv_splits: list[int]
    to_rank_major: torch.Tensor


def expert_major_order(recv: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Gather index turning rank-major rows into expert-major rows.

    Args:
        recv: [ep, E_l] int64, ``recv[r, j]`` = rows received from rank r for local expert j;
            the received rows are ordered (r, j) (rank-major).
        n_rows: ``recv.sum()`` as a host int (so nothing here waits on the device).
    Returns: [n_rows] int64 ``src`` with ``expert_major = rank_major[src]``, rows ordered (j, r).
    """
    ep, n_local = recv.shape
    sizes_rm = recv.flatten()  # chunk (r, j) at r*E_l + j
    start_rm = torch.cumsum(sizes_rm, 0) - sizes_rm  # [ep*E_l] first rank-major row of each chunk
    sizes_em = recv.t().flatten()  # chunk (j, r) at j*ep + r
    start_em = torch.cumsum(sizes_em, 0) - sizes_em
    chunk_em = torch.repeat_interleave(torch.arange(ep * n_local, device=recv.device), sizes_em,
                                       output_size=n_rows)  # [M] expert-major chunk of each row
    within = torch.arange(n_rows, device=recv.device) - start_em[chunk_em]
    return start_rm.view(ep, n_local).t().flatten()[chunk_em] + within


class ExpertParallelDispatch(ExpertDispatch):
    """All-to-all dispatcher of one EP group (see the module docstring for the algorithm).

    Args:
        group: the ``torch.distributed`` process group of the ``ep`` ranks (gloo or NCCL;
            with NCCL, the MoE inputs must be on this rank's CUDA device).
        ep: group size. ep_rank: this rank's index in ``group``. n_experts: E (global).
    Raises:
        ValueError: E % ep != 0, ep_rank outside [0, ep), or ``group``'s size or this
            rank's index in it differ from ``ep`` / ``ep_rank``.
    Host syncs: one per :meth:`dispatch` (the split sizes of the row all-to-all).
    """

    def __init__(self, group, ep: int, ep_rank: int, n_experts: int) -> None:
        _check_layout(group, ep, ep_rank, n_experts)
        self.group = group if group is not None else dist.group.WORLD
        self.ep, self.ep_rank, self.n_experts = ep, ep_rank, n_experts
        self.n_local = n_experts // ep

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds."""
        return range(self.ep_rank * self.n_local, (self.ep_rank + 1) * self.n_local)

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Exchange]:
        """x_sorted [N, dim] (sorted by global expert), counts [E] int64 -> (x_local [M, dim]
        grouped by local expert, local_counts [E/ep] int64, ctx). Collective over ``group``."""
        recv, send_splits, recv_splits = self.exchange_counts(counts)
        x_rank_major = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, self.group)
        src = expert_major_order(recv, sum(recv_splits))
        return x_rank_major[src], recv.sum(0), _Exchange(send_splits, recv_splits, _inverse(src))

    def combine(self, y_local: torch.Tensor, ctx: _Exchange) -> torch.Tensor:
        """y_local [M, dim] (expert-major) -> [N, dim] in ``dispatch``'s x_sorted order. Collective."""
        y_rank_major = y_local[ctx.to_rank_major]
        return all_to_all_single_autograd(y_rank_major, ctx.send_splits, ctx.recv_splits, self.group)


    def exchange_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """counts [E] int64 (this rank's rows per global expert) -> (recv [ep, E/ep] int64: rows rank r sends for
        my local expert j; send_splits, recv_splits: rows per rank, host ints). One all-to-all of the count table
        and the one host read of the split sizes. Collective over ``group``."""
        send = counts.view(self.ep, self.n_local).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[r, j]: rows from rank r for my expert j
        send_splits, recv_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the one host sync
        return recv, send_splits, recv_splits

    @torch.compiler.disable
    def fp8_experts(self, x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    limit: float) -> torch.Tensor:
        """Dispatch, the local experts' FP8 MLP and combine, with e4m3 rows on the wire into the experts.

        ``x_sorted`` [N, dim] (sorted by global expert) is cast to e4m3 rowwise where it is, and crosses the
        all-to-all as dim bytes plus a 4-byte scale per row instead of 2·dim bytes; the received rows are exactly
        what ``fp8_experts.fp8_expert_mlp`` would cast them to. In the backward the output gradient crosses the
        reverse all-to-all the same way (the MLP casts it for its dh GEMM anyway); the input gradient returns in
        the compute dtype. The weight gradients then use the e4m3 values of x and dy (dequantised exactly into the
        compute dtype), as DeepSeek-V3's FP8 framework does (report §3.3, its dispatch and wgrad inputs in FP8);
        the forward output and the input gradient are those of ``fp8_expert_mlp``.

        Args:
            x_sorted: [N, dim] compute dtype. counts: [E] int64 rows per global expert.
            w13: [E/ep, 2*inter, dim] the local experts' w1 over w3; w2: [E/ep, dim, inter] (compute dtype).
            limit: the SwiGLU clamp (0 = none).
        Returns: [N, dim] the experts' (unweighted) outputs in x_sorted's order. Collective over ``group``.
        Raises: ValueError for widths that are not multiples of 16 (``fp8_experts.check_widths``).
        Host syncs: one (the split sizes), as :meth:`dispatch`.
        Source: DeepSeek-V3 report §3.3 (FP8 before the dispatch, bf16 combine); seed 000 §9 (routed experts FP8).
        """
        fp8_experts.check_widths(x_sorted.shape[-1], w2.shape[-1])
        return Fp8ExpertExchange.apply(x_sorted.contiguous(), w13, w2, counts, self, float(limit))


def _inverse(src: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of the gather ``src`` [M] (expert-major -> rank-major positions)."""
    return torch.empty_like(src).scatter_(0, src, torch.arange(src.numel(), device=src.device))


def _pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [n, k] e4m3, scale [n] float32 -> [n, k + 4] uint8: each row's bytes then its scale's (one message)."""
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8).view(-1, 4)], dim=1)


def _unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_pack`: [n, k + 4] uint8 -> (q [n, k] e4m3, scale [n] float32), contiguous."""
    return (packed[:, :-4].contiguous().view(fp8_experts.E4M3),
            packed[:, -4:].contiguous().view(torch.float32).view(-1))


def _all_to_all(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of ``t`` (``in_splits[r]`` for rank r) exchanged; returns ``sum(out_splits)`` rows received."""
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t, out_splits, in_splits, group=group)
    return out


class Fp8ExpertExchange(torch.autograd.Function):
    """``ExpertParallelDispatch.fp8_experts`` as one autograd function (rows into the experts travel as e4m3).

    forward(x_sorted [N, dim], w13 [E_l, 2I, dim], w2 [E_l, dim, I], counts [E], dispatcher, limit) -> [N, dim].
    Saved: the received e4m3 rows and their scales (half x's bf16 bytes), g13, the weight stacks, the exchange.
    """

    @staticmethod
    def forward(ctx, x_sorted, w13, w2, counts, dispatcher, limit: float):
        group, dtype = dispatcher.group, x_sorted.dtype
        recv, send_splits, recv_splits = dispatcher.exchange_counts(counts)
        xq, xs = fp8_experts.cast_rows(x_sorted)
        wire = _all_to_all(_pack(xq, xs), recv_splits, send_splits, group)
        m = sum(recv_splits)
        src = expert_major_order(recv, m)
        xq_l, xs_l = _unpack(wire[src])  # expert-major (local expert, source rank)
        ends = torch.cumsum(recv.sum(0), 0, dtype=torch.int32)
        if m:
            y_l, g13 = fp8_experts.mlp_forward(xq_l, xs_l, w13, w2, ends, limit, dtype)
        else:  # no rows for my experts: nothing to compute (the grouped GEMMs refuse zero rows)
            y_l, g13 = x_sorted.new_empty(0, w2.shape[1]), x_sorted.new_empty(0, w13.shape[1])
        inverse = _inverse(src)
        ctx.save_for_backward(xq_l, xs_l, g13, w13, w2, ends, src, inverse)
        ctx.exchange = (group, send_splits, recv_splits)
        ctx.limit, ctx.dtype = limit, dtype
        return _all_to_all(y_l[inverse], send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, dy):
        xq_l, xs_l, g13, w13, w2, ends, src, inverse = ctx.saved_tensors
        group, send_splits, recv_splits = ctx.exchange
        dtype = ctx.dtype
        dyq, dys = fp8_experts.cast_rows(dy.to(dtype).contiguous())
        dyq_l, dys_l = _unpack(_all_to_all(_pack(dyq, dys), recv_splits, send_splits, group)[src])
        if xq_l.shape[0]:
            x_l = fp8_experts.dequantize_rows(xq_l, xs_l, dtype)
            dy_l = fp8_experts.dequantize_rows(dyq_l, dys_l, dtype)
            dx_l, dw13, dw2 = fp8_experts.mlp_backward(dyq_l, dys_l, dy_l, x_l, g13, w13, w2, ends, ctx.limit,
                                                       ctx.needs_input_grad[1:3])
        else:
            dx_l, dw13, dw2 = dy.new_empty(0, w13.shape[2], dtype=dtype), torch.zeros_like(w13), torch.zeros_like(w2)
        dx = _all_to_all(dx_l[inverse], send_splits, recv_splits, group)
        return dx, dw13, dw2, None, None, None


def _check_layout(group, ep: int, ep_rank: int, n_experts: int) -> None:
    if ep < 1 or n_experts % ep:
        raise ValueError(f"expert parallel size ep={ep} with n_routed_experts={n_experts}: E must be a multiple "
                         f"of ep (each EP rank holds E/ep experts). Fix: choose parallel.ep from the divisors of "
                         f"{n_experts}.")
    if not 0 <= ep_rank < ep:
        raise ValueError(f"ep_rank={ep_rank}: must be in [0, {ep}). Fix: pass this rank's index in the EP group.")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (ep, ep_rank):
        raise ValueError(f"EP group has {size} ranks and this rank is {rank} in it, but ep={ep}, ep_rank={ep_rank}. "
                         "Fix: pass the group's own size and this rank's index in it.")


def apply_expert_parallel(model: nn.Module, group, ep: int, ep_rank: int) -> None:
    """Make every ``MoE`` of ``model`` (main and MTP layers) expert-parallel over ``group``, in place.

    Each MoE keeps only experts ``ep_rank*E/ep .. (ep_rank+1)*E/ep - 1`` (the others are
    deleted from its ``experts`` ModuleDict, so the kept parameters keep their names,
    e.g. ``layers.3.ffn.experts.17.w1.weight``) and gets an :class:`ExpertParallelDispatch`.
    Router, shared expert, balance loss and ``expert_counts`` are unchanged (every rank
    routes its own tokens over all E experts). Call it on every rank of ``group``, on a
    model with all experts, before building the optimizer.

    Raises:
        ValueError: E % ep != 0 (fix: an ep dividing E), a bad ``ep``/``ep_rank`` for
            ``group``, or a MoE that no longer holds all E experts (applied twice).
    """
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    dispatchers: dict[int, ExpertParallelDispatch] = {}
    for moe in moes:
        if moe.n_experts not in dispatchers:
            dispatchers[moe.n_experts] = ExpertParallelDispatch(group, ep, ep_rank, moe.n_experts)
        if len(moe.experts) != moe.n_experts:
            raise ValueError(f"a MoE holds {len(moe.experts)} of its {moe.n_experts} routed experts: expert "
                             "parallelism was already applied. Fix: apply it once, to a model with all experts.")
    for moe in moes:
        dispatcher = dispatchers[moe.n_experts]
        keep = {str(e) for e in dispatcher.local_experts}
        for name in [n for n in moe.experts if n not in keep]:
            del moe.experts[name]
        moe.dispatcher = dispatcher


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of every routed-expert parameter of ``model``.

    These are the parameters that EP spreads over ranks: their gradients are reduced over
    the ranks holding the same experts, not over every data-parallel rank. The shared
    expert and the router are not included.
    """
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, MoE):
            names.update(f"{prefix}.experts.{n}" if prefix else f"experts.{n}"
                         for n, _ in module.experts.named_parameters())
    return names
