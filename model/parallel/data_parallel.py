"""Gradient reduction for unsharded data parallelism (``parallel.distributed_optimizer: false``).

Spec: docs/parallelism.md "Rank grid": over the S = dp·cp ranks of one pipeline rank the
gradient is ``(1/dp) · Σ_S g`` — summed over CP (each CP rank holds the partial gradient of
its rows of one replica's batch), averaged over the dp replicas. Proof: with ``g[d][c]`` the
gradient of replica d, CP rank c, the CP sum is ``G[d] = Σ_c g[d][c]``, the DP mean
``(1/dp) Σ_d G[d] = (1/dp) Σ_S g``; one all-reduce SUM over S divided by dp gives it on every rank.

Routed experts (expert parallel): a rank holds E/ep experts, and the ``edp = S / ep`` ranks that
hold the same experts each computed the gradient of the tokens their EP group routed to them, so
``reduce_gradients(expert_params, edp_group, dp)`` gives the same ``(1/dp) · Σ_S g`` for them.

One flat buffer per call, parameters in the order given (the same on every rank), like
``v4launch.training.dist.average_grads`` (no DDP buckets to rebuild when a phase change adds the
indexer parameters).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def reduce_gradients(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None, dp: int) -> None:
    """In place: ``p.grad = (1/dp) · Σ_group p.grad`` for every parameter, in one flat all-reduce.

    Args:
        params: the parameters (plain tensors, same order and shapes on every rank of ``group``).
            A parameter without a gradient counts as zeros and gets a zero gradient first, so the
            ranks' buffers always match.
        group: the S ranks of this pipeline rank (or, for routed experts, the edp ranks holding the
            same experts); None = the default group. A group of one rank only divides.
        dp: data-parallel replicas (the divisor); cp = S / dp ranks of a replica are summed.
    Buffer dtype: float64 if any gradient is float64, else float32 (bf16 gradients are summed
        in float32 and rounded once).
    Raises:
        ValueError: ``dp`` < 1; a parameter is a DTensor (sharded: FSDP reduces it).
    """
    if dp < 1:
        raise ValueError(f"reduce_gradients: dp={dp} must be >= 1. Fix: pass the data-parallel size of the stage.")
    params = [p for p in params if p.requires_grad]
    if any(type(p).__name__ == "DTensor" for p in params):
        raise ValueError("reduce_gradients: a parameter is sharded (DTensor); FSDP reduces those. Fix: pass only "
                         "unsharded parameters (e.g. the routed experts that apply_fsdp ignored).")
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat /= dp
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
