"""Context parallelism for the V4 model (seed 000 §5–6): interface, single-device default, gloo/NCCL runtime.

Job-facing API (see docs/context_parallel.md)::

    from v4launch.model.parallel import ContextParallelGroup, shard_thd_batch
    cp = ContextParallelGroup(group)                    # a torch.distributed group of the CP ranks
    model = V4Model(args, phase, cp=cp)
    local = shard_thd_batch(tokens, labels, cu_seqlens, cp.rank, cp.size)
    out = model(local.tokens, local.cu_seqlens, max_seqlen, local.labels)   # losses: global means
    (out.lm_loss + ...).backward(); all-reduce(SUM) every parameter gradient over the CP group

``torch.distributed`` is imported only in this package (``group.py``, ``comm.py``), and only
when ``ContextParallelGroup`` / ``shard_thd_batch`` are first used.
"""

from __future__ import annotations

from .base import SINGLE_DEVICE, ContextParallel, Shard

__all__ = ["SINGLE_DEVICE", "ContextParallel", "Shard", "ContextParallelGroup", "LocalBatch", "shard_thd_batch"]


def __getattr__(name: str):
    # Lazy: importing the model must not import torch.distributed or the validators package.
    if name in ("ContextParallelGroup", "LocalBatch", "shard_thd_batch"):
        from . import group

        return getattr(group, name)
    raise AttributeError(name)
