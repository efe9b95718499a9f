"""Autograd-aware CP collectives on ``torch.distributed`` (gloo or NCCL), with a byte counter.

Spec: seed 000 §5.1 (left boundary exchange; backward sends the boundary gradient to the
owning rank), §5.2 (fixed-capacity all-gather of owned compressed rows), §10 (the
collectives are outside any recompute boundary). Upstream: Megatron
``csa_utils/cp_utils.py`` (boundary exchange, capacity) — reimplemented, not copied.

Backward order: every collective here is an autograd node; the model ties each gathered
buffer to the layer output and to the indexer KL (``ContextParallelGroup.tie``) so every
rank runs the same backward collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Bytes this rank moved, one record per collective call (forward and backward).

    ``records``: list of dicts ``{"op", "what", "direction", "sent", "received"}`` (bytes).
    ``op``: "boundary" (P2P), "allgather", "next_first" (P2P, MTP shift), "allreduce".
    """

    records: list = field(default_factory=list)

    def add(self, op: str, what: str, direction: str, sent: int, received: int) -> None:
        self.records.append(dict(op=op, what=what, direction=direction, sent=int(sent), received=int(received)))

    def total(self, op: str, key: str = "sent", direction: str = "forward", what: str | None = None) -> int:
        """Sum of ``key`` bytes over the records of ``op`` (and ``what``) in ``direction``."""
        return sum(r[key] for r in self.records
                   if r["op"] == op and r["direction"] == direction and (what is None or r["what"] == what))

    def clear(self) -> None:
        self.records.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """A CP process group: ranks, neighbours, the byte counter and the device for host scalars.

    ``scalar_device``: where a host-side count (an int the model sums over CP) is placed for its
    all-reduce — the current CUDA device when the group has an NCCL backend (NCCL moves only
    device tensors), else the CPU.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.traffic = Traffic()
        nccl = "nccl" in str(dist.get_backend(group))
        self.scalar_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def shift_right(self, send: torch.Tensor | None, recv_like: torch.Tensor, op: str, what: str,
                    direction: str) -> torch.Tensor | None:
        """Send ``send`` to rank+1 and receive a tensor like ``recv_like`` from rank-1 (P2P).

        The first rank receives nothing (returns None); the last rank sends nothing.
        """
        return self._shift(send, recv_like, +1, op, what, direction)

    def shift_left(self, send: torch.Tensor | None, recv_like: torch.Tensor, op: str, what: str,
                   direction: str) -> torch.Tensor | None:
        """Send ``send`` to rank-1 and receive from rank+1; the last rank receives None."""
        return self._shift(send, recv_like, -1, op, what, direction)

    def _shift(self, send, recv_like, step: int, op: str, what: str, direction: str):
        dst, src = self.rank + step, self.rank - step
        reqs, out, sent = [], None, 0
        if 0 <= src < self.size:
            out = torch.empty_like(recv_like)
            reqs.append(dist.irecv(out, src=self._global(src), group=self.group))
        if 0 <= dst < self.size:
            payload = send.contiguous()
            reqs.append(dist.isend(payload, dst=self._global(dst), group=self.group))
            sent = _nbytes(payload)
        for r in reqs:
            r.wait()
        self.traffic.add(op, what, direction, sent, 0 if out is None else _nbytes(out))
        return out

    def all_reduce(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Elementwise SUM over the group (a new tensor; no autograd)."""
        out = t.detach().clone().contiguous()
        dist.all_reduce(out, group=self.group)
        self.traffic.add("allreduce", what, "forward", _nbytes(out), _nbytes(out))
        return out


class BoundaryExchange(torch.autograd.Function):
    """x [L, ...] -> [B + L, ...]: the left neighbour's last B rows, then x (zeros on rank 0).

    Backward: the gradient of the B received rows goes back to the left neighbour and is
    added to its last B rows; the first B rows of this rank's gradient are never dropped.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, comm: Comm, what: str) -> torch.Tensor:
        ctx.width, ctx.comm, ctx.what = width, comm, what
        like = x[:width]
        left = comm.shift_right(x[-width:], like, "boundary", what, "forward")
        left = torch.zeros_like(like) if left is None else left
        return torch.cat((left, x))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        B, comm = ctx.width, ctx.comm
        grad_x = grad[B:].clone()
        back = comm.shift_left(grad[:B], grad[:B], "boundary", ctx.what, "backward")
        if back is not None:
            grad_x[-B:] += back
        return grad_x, None, None, None


class AllGather(torch.autograd.Function):
    """buf [cap, d] -> [size * cap, d] rank-major. Backward: SUM over ranks, keep own rows.

    The backward uses one all-reduce of the gathered gradient (gloo has no
    reduce-scatter); a reduce-scatter would move 1/size of those bytes.
    """

    @staticmethod
    def forward(ctx, buf: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
        ctx.comm, ctx.what, ctx.cap = comm, what, buf.shape[0]
        buf = buf.contiguous()
        parts = [torch.empty_like(buf) for _ in range(comm.size)]
        dist.all_gather(parts, buf, group=comm.group)
        comm.traffic.add("allgather", what, "forward", _nbytes(buf), comm.size * _nbytes(buf))
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm, cap = ctx.comm, ctx.cap
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=comm.group)
        comm.traffic.add("allgather", ctx.what, "backward", _nbytes(total), _nbytes(total))
        return total[comm.rank * cap:(comm.rank + 1) * cap], None, None


class SumPartial(torch.autograd.Function):
    """0-d partial loss -> its SUM over ranks (replicated). Backward: identity (local contribution)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
        return comm.all_reduce(t, what)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class Tie(torch.autograd.Function):
    """Return ``out`` unchanged; give ``anchor`` a zero gradient so its backward always runs."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)
