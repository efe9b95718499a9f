"""Harness for the expert-parallel tests: spawn gloo ranks, run EP (optionally with CP) and a one-process reference.

Rank grid (docs/parallelism.md): ``rank = dp_rank * cp + cp_rank``; CP groups are ``cp``
consecutive ranks, EP groups ``ep`` consecutive ranks (EP folds over dp·cp). Every
data-parallel replica ``d`` gets its own packed batch, so EP ranks route DIFFERENT tokens.

Every rank builds the same seeded model and every replica's batch, runs the reference
(all experts, no EP, no CP) on each replica's whole batch, backward of the sum of their
``lm + sum(aux)``; then applies EP (and CP) and runs its own rows. It reports:

* losses: max |loss - reference loss of its replica| (CP losses are replica means);
* expert grads: for each routed-expert parameter held here, the sum over the ranks holding
  the same experts (the "edp" ranks) vs the reference, relative to the reference's max;
* other grads: the sum over every rank vs the reference (relative);
* counts: ``expert_counts`` [E] summed over the CP group vs the reference replica's counts.

A uniquely named module so no other conftest shadows it.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/model (v4_helpers)

from v4_helpers import build, gloo_spawn, packed_batch, tiny_args  # noqa: E402

from v4launch.model.moe import MoE  # noqa: E402
from v4launch.model.parallel import (ContextParallelGroup, apply_expert_parallel,  # noqa: E402
                                     expert_parameter_names, shard_thd_batch)


def spawn(world: int, cases: list[dict], tmp_path) -> list[list[dict]]:
    """Run ``cases`` (dicts for :func:`ep_case`) on ``world`` gloo ranks; returns results[rank][case]."""
    return gloo_spawn(world, cases, tmp_path, run_case)


def run_case(case: dict) -> dict:
    """One case on this rank (dispatched by its contents)."""
    return ep_case(case)


def _groups(world: int, size: int, stride: int) -> list[list[int]]:
    """Rank lists of ``world / size`` groups of ``size`` ranks ``stride`` apart."""
    if stride == 1:
        return [list(range(g * size, (g + 1) * size)) for g in range(world // size)]
    return [list(range(g, world, stride)) for g in range(stride)]


def _my_group(rank_lists: list[list[int]]):
    """Create every group (collective: all ranks, same order) and return this rank's one."""
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = g
    return mine


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (max |a| when b is all zero)."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def _counts(model) -> list[torch.Tensor]:
    return [m.expert_counts.clone() for m in model.modules() if isinstance(m, MoE)]


def _total(out):
    return out.lm_loss + sum(out.aux_losses.values())


def ep_case(case: dict) -> dict:
    """One forward/backward of the tiny model at ``case["ep"]`` × ``case["cp"]`` vs the reference."""
    world, ep, cp = dist.get_world_size(), case["ep"], case["cp"]
    rank, dp = dist.get_rank(), world // cp
    args = tiny_args(**case.get("args", {}))
    gen = torch.Generator().manual_seed(case["seed"])
    model = build(args, case.get("phase", "dense"), gen, chunk_size=16)
    batches = [packed_batch(case["lengths"], args.vocab_size, gen) for _ in range(dp)]

    ref_losses, ref_counts, ref_total = [], [], 0.0
    for tokens, cu, max_len, labels in batches:
        out = model(tokens, cu, max_len, labels)
        ref_losses.append({"lm": out.lm_loss.detach(), **{k: v.detach() for k, v in out.aux_losses.items()}})
        ref_counts.append(_counts(model))
        for m in model.modules():
            if isinstance(m, MoE):
                m.expert_counts.zero_()
        ref_total = ref_total + _total(out)
    ref_total.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    ep_group = _my_group(_groups(world, ep, 1))
    edp_group = _my_group(_groups(world, world // ep, ep))  # ranks holding the same experts
    cp_group = _my_group(_groups(world, cp, 1))
    ep_rank, dp_rank, cp_rank = rank % ep, rank // cp, rank % cp
    apply_expert_parallel(model, ep_group, ep, ep_rank)
    tokens, cu, max_len, labels = batches[dp_rank]
    if cp > 1:
        model.cp = ContextParallelGroup(cp_group)
        local = shard_thd_batch(tokens, labels, cu, cp_rank, cp)
        tokens, cu, labels = local.tokens, local.cu_seqlens, local.labels
    out = model(tokens, cu, max_len, labels)
    _total(out).backward()

    losses = {"lm": abs(out.lm_loss.item() - ref_losses[dp_rank]["lm"].item())}
    losses.update({k: abs(v.item() - ref_losses[dp_rank][k].item()) for k, v in out.aux_losses.items()})
    expert_names = expert_parameter_names(model)
    expert_err, other_err, worst_expert, worst_other = 0.0, 0.0, "", ""
    for name, p in model.named_parameters():
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        dist.all_reduce(g, group=edp_group if name in expert_names else None)
        e = _rel(g, ref_grads[name])
        if name in expert_names and e >= expert_err:
            expert_err, worst_expert = e, name
        elif name not in expert_names and e >= other_err:
            other_err, worst_other = e, name
    count_err = 0
    for mine, ref in zip(_counts(model), ref_counts[dp_rank]):
        dist.all_reduce(mine, group=cp_group)
        count_err = max(count_err, int((mine - ref).abs().max()))
    held = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in expert_names if n.startswith("layers.1.")})
    return dict(losses=losses, loss_names=sorted(out.aux_losses), expert_grad=expert_err, worst_expert=worst_expert,
                other_grad=other_err, worst_other=worst_other, count_err=count_err, held=held,
                n_expert_params=len(expert_names), n_tokens=int(tokens.numel()))
