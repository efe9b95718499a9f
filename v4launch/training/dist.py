"""Process-group set-up, the rank layout of each stage and the few collectives the job needs.

The rendezvous comes from the environment (torchrun, the local launcher or Slurm via
v4launch.slurm): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Backend: nccl
when CUDA is available, else gloo.

Rank layout (docs/training.md "Data and context parallelism"): the world size ``W`` is fixed
for the run; a stage with context-parallel size ``cp`` has ``dp = W / cp`` data-parallel
replicas and lays the ranks out as ``[dp][cp]``, CP innermost and contiguous::

    rank = dp_rank * cp + cp_rank          CP group d: ranks d*cp .. d*cp + cp - 1
                                           DP group c: ranks c, cp + c, 2*cp + c, ...

so with one node per CP group the boundary exchange and the all-gather stay on the node.
The CP groups of every CP size the curriculum uses are created once at start-up
(:class:`Groups`; ``new_group`` is collective over the whole world, so every rank creates
every group in the same order).

Gradients: every parameter has a gradient tensor on every rank (zeros where unused) and one
flat all-reduce SUM over the WORLD, divided by ``dp``, replaces "SUM over CP, then mean over
DP" (:func:`average_grads`). Proof: with ``g[d][c]`` the gradient of DP replica ``d``, CP rank
``c``, the CP sum gives ``G[d] = Σ_c g[d][c]`` on every rank of CP group ``d``; the DP mean
gives ``(1/dp) Σ_d G[d] = (1/dp) Σ_d Σ_c g[d][c] = (1/dp) Σ_world g``, the same on every
rank. (DP groups are therefore never built.) Scalars the model returns replicated on every
CP rank (all losses) average to their DP mean over the world: ``Σ_world x / W = Σ_d cp·x[d] /
(dp·cp)``. Instead of DDP (whose buckets would have to be rebuilt when a phase change adds
the indexer parameters) this is one flat all-reduce per step with a fixed order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """This rank's place in the world. ``owns_group``: this job created the process group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_distributed() -> DistInfo:
    """Join the process group described by the environment (no-op when WORLD_SIZE <= 1).

    An already initialised group (e.g. a test harness) is reused and left alone at teardown.
    On CUDA the group has two backends, ``cpu:gloo,cuda:nccl``: device tensors (gradients,
    activations) go over NCCL, while the host-side counts and objects that checkpointing and
    the CP loss normalisation exchange go over gloo instead of failing on an NCCL-only group.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world <= 1 and not dist.is_initialized():
        return DistInfo(rank=0, world=1, local_rank=0, device=device, owns_group=False)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo", init_method="env://")
        owns = True
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device,
                    owns_group=owns)


def teardown(info: DistInfo) -> None:
    """Destroy the process group if this job created it."""
    if info.owns_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cp_group_ranks(world: int, cp: int) -> list[list[int]]:
    """The CP groups of a stage: ``[[d*cp + c for c in range(cp)] for d in range(world // cp)]``.

    Raises:
        ValueError: ``cp`` does not divide ``world``.
    """
    if cp < 1 or world % cp:
        raise ValueError(f"cp={cp} does not divide the world size {world}")
    return [[d * cp + c for c in range(cp)] for d in range(world // cp)]


def dp_group_ranks(world: int, cp: int) -> list[list[int]]:
    """The DP groups of a stage (ranks with the same CP rank): ``[[d*cp + c for d in range(dp)] for c]``."""
    if cp < 1 or world % cp:
        raise ValueError(f"cp={cp} does not divide the world size {world}")
    return [[d * cp + c for d in range(world // cp)] for c in range(cp)]


@dataclass(frozen=True)
class Layout:
    """This rank's place in one stage's ``[dp][cp]`` grid (see the module docstring).

    Attributes:
        world, dp, cp: sizes (``world = dp · cp``; tp = pp = 1).
        dp_rank, cp_rank: ``divmod(rank, cp)``; the data loader is sharded by ``dp_rank / dp``.
        hooks: what the model gets as ``cp=``: a ``ContextParallelGroup`` over this rank's CP
            group when ``cp > 1``, else the single-device default.
    """

    world: int
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    hooks: Any

    def describe(self) -> str:
        """``dp 2 x cp 1`` (for log lines)."""
        return describe_layout(self.dp, self.cp)


def describe_layout(dp: int, cp: int) -> str:
    """``dp 2 x cp 1``: a rank layout in log lines (a live ``Layout`` or one read from a manifest)."""
    return f"dp {dp} x cp {cp}"


class Groups:
    """The CP process groups of every CP size in ``cp_sizes``, created once on every rank.

    ``layout(cp)`` returns this rank's :class:`Layout` for a stage with that CP size.
    """

    def __init__(self, info: DistInfo, cp_sizes: list[int] | set[int]) -> None:
        from ..model.parallel import SINGLE_DEVICE, ContextParallelGroup

        self.info = info
        self._hooks: dict[int, Any] = {1: SINGLE_DEVICE}
        for cp in sorted(set(cp_sizes) - {1}):
            mine = None
            for ranks in cp_group_ranks(info.world, cp):  # collective: same groups, same order on every rank
                group = dist.new_group(ranks)
                if info.rank in ranks:
                    mine = group
            self._hooks[cp] = ContextParallelGroup(mine)

    def layout(self, cp: int) -> Layout:
        """This rank's layout for a stage of CP size ``cp`` (one of ``cp_sizes``)."""
        world = self.info.world
        if cp not in self._hooks:
            raise ValueError(f"no CP groups of size {cp} were built (sizes: {sorted(self._hooks)})")
        dp_rank, cp_rank = divmod(self.info.rank, cp)
        return Layout(world=world, dp=world // cp, cp=cp, dp_rank=dp_rank, cp_rank=cp_rank, hooks=self._hooks[cp])


def fill_missing_grads(params: list[torch.Tensor]) -> None:
    """Give every parameter a gradient tensor (zeros where the step did not reach it)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def average_grads(params: list[torch.Tensor], info: DistInfo, dp: int | None = None) -> None:
    """SUM gradients over each CP group and average them over the ``dp`` data-parallel replicas.

    One flat all-reduce SUM over the world (fixed order) divided by ``dp`` (default: the world,
    i.e. cp = 1); equal to CP-sum + DP-mean (module docstring). Float32 buffer (float64 when a
    gradient is float64).
    """
    if not info.active:
        return
    dp = info.world if dp is None else dp
    grads = [p.grad for p in params]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
    dist.all_reduce(flat)
    flat /= dp
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def sum_tensors(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """All-reduce (sum) ``tensors`` in place over the world, e.g. the experts' token counts before the
    bias update (each rank counts only its own rows, so the world sum is the global load under CP)."""
    if info.active:
        for t in tensors:
            dist.all_reduce(t)


def mean_scalars(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Average a dict of floats over ranks (same keys on every rank, sorted order)."""
    if not info.active or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return {k: float(v) / info.world for k, v in zip(keys, t.tolist())}


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True if ``flag`` is true on any rank (all ranks agree, e.g. to stop at the same step)."""
    if not info.active:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
