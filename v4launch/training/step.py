"""One optimizer step and the held-out evaluation.

Loss of one micro-batch (docs/training.md "Loss composition")::

    total = lm_loss
          + attention.indexer_loss_coeff · Σ_layers indexer_kl/layer_NN      (warmup, sparse)
          + model.moe.balance_loss_alpha · Σ_layers balance/layer_NN
          + w_mtp · Σ_depths mtp/depth_K     (w_mtp = model.mtp.loss_weight, then
                                              loss_weight_after_decay once the LR decays)

and the step backpropagates ``total / accum`` for each of its ``accum`` micro-batches, so the
LM loss and EVERY auxiliary loss carry the same 1/accum factor (seed 004 item 6c: an aux loss
seeded at 1.0 under accumulation is ``accum`` times too strong). The raw value of every aux
loss is reported per name and summed per kind; nothing the model returns is left out.

Under context parallelism each rank forwards its contiguous slice of the micro-batch; the
model returns GLOBAL losses (identical on every CP rank) whose backward is local, so the
gradients are SUMMED over the CP group and averaged over the DP replicas (``average_grads``
with ``dp``); expert loads are summed over the world; a token is counted once (÷ cp).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .dist import DistInfo, average_grads, fill_missing_grads, mean_scalars, sum_tensors
from .optim import Optimizers

AUX_KINDS = ("indexer_kl", "balance", "mtp")
"""Prefixes of the model's auxiliary loss names (``<kind>/<where>``)."""


@dataclass(frozen=True)
class LossWeights:
    """Coefficient applied to each auxiliary-loss kind (the raw losses come unscaled from the model)."""

    indexer_kl: float
    balance: float
    mtp: float

    def of(self, name: str) -> float:
        """Weight of aux loss ``name`` (``indexer_kl/layer_01`` → indexer_kl).

        Raises:
            KeyError: an aux-loss kind this job does not know (it would otherwise train unweighted).
        """
        kind = name.split("/", 1)[0]
        if kind not in AUX_KINDS:
            raise KeyError(f"the model returned aux loss {name!r} of unknown kind {kind!r}; known: {AUX_KINDS}")
        return getattr(self, kind)


def loss_weights(recipe: Any, decay_started: bool) -> LossWeights:
    """The recipe's aux-loss coefficients at a step (MTP drops to its after-decay weight once the LR decays)."""
    mtp = recipe.model.mtp
    return LossWeights(indexer_kl=recipe.attention.indexer_loss_coeff, balance=recipe.model.moe.balance_loss_alpha,
                       mtp=mtp.loss_weight_after_decay if decay_started else mtp.loss_weight)


def compose_loss(lm_loss: torch.Tensor, aux: dict[str, torch.Tensor], weights: LossWeights) -> torch.Tensor:
    """``lm_loss + Σ weight(name) · aux[name]`` (0-d; names summed in sorted order for determinism)."""
    total = lm_loss
    for name in sorted(aux):
        total = total + weights.of(name) * aux[name]
    return total


@dataclass
class StepStats:
    """Everything one step reports (losses averaged over micro-batches and data-parallel ranks).

    ``aux``: raw value per aux-loss name. ``kinds``: raw sum per kind. ``weighted``: coefficient · kind sum.
    ``total``: lm_loss + Σ weighted. ``tokens``: training tokens of the step (all DP replicas, each once).
    """

    lm_loss: float
    aux: dict[str, float] = field(default_factory=dict)
    kinds: dict[str, float] = field(default_factory=dict)
    weighted: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    grad_norm: float = 0.0
    tokens: int = 0


def autocast_for(dtype_name: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16 autocast when the recipe asks for bf16 and the device supports it; otherwise no autocast."""
    if dtype_name == "bf16":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cpu":
            return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _stats(sums: dict[str, float], n: int, weights: LossWeights, info: DistInfo) -> StepStats:
    means = mean_scalars({k: v / n for k, v in sums.items()}, info)
    aux = {k: v for k, v in means.items() if k != "lm_loss"}
    kinds = {kind: sum(v for k, v in aux.items() if k.startswith(kind + "/")) for kind in AUX_KINDS
             if any(k.startswith(kind + "/") for k in aux)}
    weighted = {kind: getattr(weights, kind) * v for kind, v in kinds.items()}
    return StepStats(lm_loss=means["lm_loss"], aux=aux, kinds=kinds, weighted=weighted,
                     total=means["lm_loss"] + sum(weighted.values()))


def accumulate(model: nn.Module, micro_batches: Iterable[Any], *, accum: int, weights: LossWeights,
               autocast: Callable[[], contextlib.AbstractContextManager]) -> tuple[dict[str, torch.Tensor], int, int]:
    """Forward + backward of each micro-batch with ``total / accum``; gradients accumulate in ``.grad``.

    Returns (sum over micro-batches of each loss name's raw value as a detached 0-d tensor on the
    model's device -- summed there, so nothing waits for the device inside the step --, micro-batches,
    real tokens of the micro-batches: under CP the whole micro-batch's, ``num_real_tokens`` stays global).

    Raises:
        RuntimeError: the number of micro-batches is not ``accum``.
    """
    sums: dict[str, torch.Tensor] = {}
    n = tokens = 0
    for mb in micro_batches:
        with autocast():
            out = model(mb.tokens, mb.cu_seqlens, mb.max_seqlen, mb.labels)
        loss = compose_loss(out.lm_loss, out.aux_losses, weights)
        (loss / accum).backward()
        for name, value in (("lm_loss", out.lm_loss), *out.aux_losses.items()):
            value = value.detach().to(torch.float64)
            sums[name] = value if name not in sums else sums[name] + value
        n += 1
        tokens += int(getattr(mb, "num_real_tokens", mb.tokens.numel()))
    if n != accum:
        raise RuntimeError(f"step got {n} micro-batches, expected {accum}")
    return sums, n, tokens


def train_step(model: nn.Module, opt: Optimizers, micro_batches: Iterable[Any], *, accum: int,
               weights: LossWeights, grad_clip: float, bias_speed: float, info: DistInfo,
               autocast: Callable[[], contextlib.AbstractContextManager], cp: int = 1) -> StepStats:
    """Forward/backward ``accum`` micro-batches, reduce grads over ranks, clip, step, update router biases.

    Args:
        micro_batches: ``accum`` packed batches (``tokens`` [T], ``labels`` [T], ``cu_seqlens`` [N+1],
            ``max_seqlen``) on the model's device; under CP ``tokens`` / ``labels`` are this rank's
            ``T / cp`` rows and ``cu_seqlens`` the global table.
        accum: micro-batches per step on this rank; every loss term is scaled by 1/accum.
        grad_clip: global L2 norm clip (0 = no clipping; the norm is still reported).
        bias_speed: aux-loss-free router bias speed gamma (expert loads summed over ranks first).
        cp: context-parallel size of the stage (the world holds ``dp = world / cp`` replicas).
    """
    model.train()
    sums, n, tokens = accumulate(model, micro_batches, accum=accum, weights=weights, autocast=autocast)
    params = opt.params
    fill_missing_grads(params)
    average_grads(params, info, dp=info.world // cp)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    opt.step()
    opt.zero_grad()
    sum_tensors([m.expert_counts for m in model.modules() if hasattr(m, "expert_counts")], info)
    model.update_router_bias(bias_speed)
    host = to_host({**sums, "grad_norm": norm})  # the step's one device -> host transfer
    stats = _stats({k: v for k, v in host.items() if k != "grad_norm"}, n, weights, info)
    stats.grad_norm = host["grad_norm"]
    # every rank of a CP group reports its micro-batches' (global) token count: count them once
    stats.tokens = round(mean_scalars({"tokens": float(tokens)}, info)["tokens"] * info.world / cp)
    return stats


def to_host(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors (any devices) -> floats with ONE device synchronisation: stacked, then copied."""
    if not values:
        return {}
    keys = list(values)
    device = values[keys[0]].device
    stacked = torch.stack([values[k].detach().to(device=device, dtype=torch.float64).reshape(()) for k in keys])
    return dict(zip(keys, stacked.tolist()))


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Any], info: DistInfo,
             autocast: Callable[[], contextlib.AbstractContextManager]) -> dict[str, float]:
    """Mean held-out LM loss (nats/token) over ``batches`` (averaged over ranks; under CP every rank of a
    CP group holds the same global value, so the world mean is the mean over DP replicas)."""
    model.eval()
    total: torch.Tensor | None = None
    n = 0
    for mb in batches:
        with autocast():
            out = model(mb.tokens, mb.cu_seqlens, mb.max_seqlen, mb.labels)
        loss = out.lm_loss.detach().to(torch.float64)
        total = loss if total is None else total + loss
        n += 1
    model.train()
    if n == 0:
        return {}
    return mean_scalars({"lm_loss": to_host({"lm_loss": total})["lm_loss"] / n}, info)
