"""Parallel hooks of the V4 model: context parallelism (seed 000 §5–6: interface, single-device default,
gloo/NCCL runtime) and expert parallelism (docs/parallelism.md).

Job-facing API (see docs/context_parallel.md)::

    from v4launch.model.parallel import ContextParallelGroup, shard_thd_batch
    cp = ContextParallelGroup(group)                    # a torch.distributed group of the CP ranks
    model = V4Model(args, phase, cp=cp)
    local = shard_thd_batch(tokens, labels, cu_seqlens, cp.rank, cp.size)
    out = model(local.tokens, local.cu_seqlens, max_seqlen, local.labels)   # losses: global means
    (out.lm_loss + ...).backward(); all-reduce(SUM) every parameter gradient over the CP group

Expert parallelism (docs/parallelism.md "Expert parallel")::

    from v4launch.model.parallel import apply_expert_parallel, expert_parameter_names
    apply_expert_parallel(model, ep_group, ep, ep_rank)   # keeps E/ep experts per MoE, all-to-all dispatch
    expert_names = expert_parameter_names(model)          # reduce these over the ranks with the same experts

``torch.distributed`` is imported only in this package (``group.py``, ``comm.py``,
``expert.py``), and only when one of their names is first used.
"""

from __future__ import annotations

from .base import SINGLE_DEVICE, SINGLE_DEVICE_EXPERTS, ContextParallel, ExpertDispatch, Shard

__all__ = ["SINGLE_DEVICE", "ContextParallel", "Shard", "ContextParallelGroup", "LocalBatch", "shard_thd_batch",
           "SINGLE_DEVICE_EXPERTS", "ExpertDispatch", "ExpertParallelDispatch", "apply_expert_parallel",
           "expert_parameter_names"]
_EXPERT = ("ExpertParallelDispatch", "apply_expert_parallel", "expert_parameter_names")


def __getattr__(name: str):
    # Lazy: importing the model must not import torch.distributed or the validators package.
    if name in ("ContextParallelGroup", "LocalBatch", "shard_thd_batch"):
        from . import group

        return getattr(group, name)
    if name in _EXPERT:
        from . import expert

        return getattr(expert, name)
    raise AttributeError(name)
