"""Gradient reduction for unsharded data parallelism (``parallel.distributed_optimizer: false``) and the
global gradient norm of any layout (sharded, unsharded, expert parallel, pipeline parallel).

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

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def reduce_gradients(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None, dp: int) -> None:
    """In place: ``p.grad = (1/dp) · Σ_group p.grad`` for every parameter, in one flat all-reduce.

    Args:
        params: the parameters (plain tensors, same order and shapes on every rank of ``group``).
            A parameter without a gradient counts as zeros and gets a zero gradient first, so the
            ranks' buffers always match.
        group: the S ranks of this pipeline rank (or, for routed experts, the edp ranks holding the
            same experts); None = the default group. A group of one rank (or no process group) only divides.
        dp: data-parallel replicas (the divisor); cp = S / dp ranks of a replica are summed.
    Buffer dtype: float64 if any gradient is float64, else float32 (bf16 gradients are summed
        in float32 and rounded once).
    Raises:
        ValueError: ``dp`` < 1; a parameter is a DTensor (sharded: FSDP reduces it).
    """
    if dp < 1:
        raise ValueError(f"reduce_gradients: dp={dp} must be >= 1. Fix: pass the data-parallel size of the stage.")
    params = [p for p in params if p.requires_grad]
    if any(isinstance(p, DTensor) for p in params):
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
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat /= dp
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, *, expert_params: Iterable[torch.Tensor] = (),
                   ep_group: dist.ProcessGroup | None = None,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of the (already reduced) gradients (:func:`grad_norm`), then scale them by
    :func:`clip_coefficient` (``min(1, max_norm / (norm + 1e-6))``): ``torch.nn.utils.clip_grad_norm_``'s rule over
    a mixture of DTensor and plain gradients it cannot take. Arguments as :func:`grad_norm`; ``max_norm`` is the clip
    threshold (``optimizer.grad_clip``; ``inf`` only measures). Returns: the norm (see :func:`grad_norm`).
    Cost: :func:`grad_norm`'s, then one ``torch._foreach_mul_`` launch per gradient dtype (a read and a write of
    every gradient; ``Optimizers.step(clip=...)`` folds it into a fused AdamW instead)."""
    params = list(params)
    norm = grad_norm(params, expert_params=expert_params, ep_group=ep_group, pp_group=pp_group)
    if math.isfinite(max_norm):  # with no threshold the scale is exactly 1: nothing to multiply
        scale_grads([p.grad for p in params if p.grad is not None], clip_coefficient(norm, max_norm))
    return norm


def grad_norm(params: Iterable[torch.Tensor], *, expert_params: Iterable[torch.Tensor] = (),
              ep_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of the (already reduced) gradients of ``params``; the gradients are not changed.

    The norm² is the sum of
    * FSDP-sharded gradients (DTensor): local shards' squares summed over their shard mesh;
    * plain gradients that every rank of the S group holds the same (after ``reduce_gradients``): local;
    * ``expert_params`` (a subset of ``params``) when ``ep_group`` is given: summed over the EP group
      (each EP rank holds other experts; the edp ranks holding the same ones count them once);
    then summed over ``pp_group`` (each pipeline rank holds other layers), if given.

    Args:
        params: every parameter this rank optimises (gradients None are skipped).
    Returns: the norm, a 0-d float32 tensor (float64 if a gradient is), the same on every rank.
    Cost: ``torch._foreach_norm`` (one launch per kind and dtype, not per parameter: one read of every gradient)
    and one 0-d all-reduce per group given.
    """
    experts = set(expert_params) if ep_group is not None else set()
    grads = [(p, p.grad) for p in params if p.grad is not None]
    dtype = torch.float64 if any(g.dtype == torch.float64 for _, g in grads) else torch.float32
    device = grads[0][1].device if grads else torch.device("cpu")
    sharded = [g.to_local() for _, g in grads if isinstance(g, DTensor)]
    expert = [g for p, g in grads if not isinstance(g, DTensor) and p in experts]
    plain = [g for p, g in grads if not isinstance(g, DTensor) and p not in experts]
    sq = {kind: _square_norm(ts, dtype, device) for kind, ts in (("sharded", sharded), ("expert", expert),
                                                                  ("plain", plain))}
    mesh = next((g.device_mesh for _, g in grads if isinstance(g, DTensor)), None)
    if mesh is not None:
        dist.all_reduce(sq["sharded"], group=mesh.get_group())
    if ep_group is not None:
        dist.all_reduce(sq["expert"], group=ep_group)
    total = sq["sharded"] + sq["plain"] + sq["expert"]
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor clipping multiplies the gradients by: ``min(1, max_norm / (norm + 1e-6))``, a 0-d tensor of
    ``norm``'s dtype and device (``torch.nn.utils.clip_grad_norm_``'s rule; no host read)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def scale_grads(grads: Iterable[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply ``grads`` in place by the 0-d ``scale`` (DTensor gradients through their local shards): one
    ``torch._foreach_mul_`` launch per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        t = g.to_local() if isinstance(g, DTensor) else g
        by_dtype.setdefault(t.dtype, []).append(t)
    for dt, ts in by_dtype.items():
        torch._foreach_mul_(ts, scale.to(dt))


def _square_norm(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Σ ‖t‖² over ``tensors`` as a 0-d ``dtype`` tensor (foreach norms, one launch per dtype; 0 when empty)."""
    if not tensors:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch._foreach_norm([t.to(dtype) for t in tensors] if dtype == torch.float64 else tensors)
    return torch.stack([n.to(dtype) for n in norms]).square().sum()
