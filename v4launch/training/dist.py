"""Process-group set-up and the few collectives the job needs (data parallel only, for now).

The rendezvous comes from the environment (torchrun, the local launcher or Slurm via
v4launch.slurm): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Backend: nccl
when CUDA is available, else gloo. Gradients are averaged by one flat all-reduce per step
(instead of DDP, whose buckets would have to be rebuilt when a phase change adds the indexer
parameters); every parameter has a gradient tensor on every rank (zeros where unused), so
the collective sees the same tensors everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
        dist.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")
        owns = True
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device,
                    owns_group=owns)


def teardown(info: DistInfo) -> None:
    """Destroy the process group if this job created it."""
    if info.owns_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def fill_missing_grads(params: list[torch.Tensor]) -> None:
    """Give every parameter a gradient tensor (zeros where the step did not reach it)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def average_grads(params: list[torch.Tensor], info: DistInfo) -> None:
    """Average gradients over the data-parallel ranks with one flat all-reduce (fixed order)."""
    if not info.active:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
    dist.all_reduce(flat)
    flat /= info.world
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def sum_tensors(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """All-reduce (sum) ``tensors`` in place, e.g. the experts' token counts before the bias update."""
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
