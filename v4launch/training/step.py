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

Under pipeline parallelism (``pipeline``: model/parallel/pipeline.py) the schedule runs the
``accum`` micro-batches through the stages; each stage's gradients equal the single-device
step's for its parameters (the schedule's 1/accum, the aux losses of non-last stages joined
by an identity autograd function). Gradients, expert loads and losses are then reduced over
the S group of the rank's pipeline rank instead of the world, the gradient norm sums every
pipeline rank's squares, and each pipeline rank's losses (its own layers; LM and MTP on the
last) are merged over the pipeline group, so the metrics look as with pp = 1.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..model.common import QueuedRead, to_host
from ..model.parallel.data_parallel import clip_coefficient, grad_norm, reduce_gradients
from .dist import DistInfo, Layout, average_grads, fill_missing_grads, mean_scalars, merge_over, sum_tensors
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


def compose_loss(lm_loss: torch.Tensor, aux: dict[str, torch.Tensor], weights: Any) -> torch.Tensor:
    """``lm_loss + Σ weight(name) · aux[name]`` (0-d; names summed in sorted order for determinism).

    ``weights``: a :class:`LossWeights`, or any object whose ``of(name)`` gives the coefficient: a 0-d device
    tensor for a step captured in a CUDA graph (``graph_step.CapturedStep``: filled before each replay).
    """
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


def _reduced_means(sums: dict[str, float], n: int, info: DistInfo, layout: Layout | None) -> dict[str, float]:
    """Per-name mean over micro-batches and the S group (the world when pp = 1), merged over the pipeline."""
    group = layout.shard_group if layout is not None else None
    means = mean_scalars({k: v / n for k, v in sums.items()}, info, group)
    if layout is not None and layout.pipe_group is not None:
        means = merge_over(means, layout.pipe_group)
    return means


def _stats(sums: dict[str, float], n: int, weights: LossWeights, info: DistInfo,
           layout: Layout | None = None) -> StepStats:
    means = _reduced_means(sums, n, info, layout)
    aux = {k: v for k, v in means.items() if k != "lm_loss"}
    kinds = {kind: sum(v for k, v in aux.items() if k.startswith(kind + "/")) for kind in AUX_KINDS
             if any(k.startswith(kind + "/") for k in aux)}
    weighted = {kind: getattr(weights, kind) * v for kind, v in kinds.items()}
    return StepStats(lm_loss=means["lm_loss"], aux=aux, kinds=kinds, weighted=weighted,
                     total=means["lm_loss"] + sum(weighted.values()))


def accumulate(model: nn.Module, micro_batches: Iterable[Any], *, accum: int, weights: LossWeights,
               autocast: Callable[[], contextlib.AbstractContextManager],
               captured: Any = None) -> tuple[dict[str, torch.Tensor], int, int]:
    """Forward + backward of each micro-batch with ``total / accum``; gradients accumulate in ``.grad``.

    ``captured``: a ``graph_step.CapturedStep`` of the stage (``compile.cuda_graph``): each micro-batch is a
    replay of the captured forward + backward instead (the same loss composition).

    Returns (sum over micro-batches of each loss name's raw value, as float64 0-d tensors on the model's
    device: nothing is read back here, :func:`queue_step` queues them with the gradient norm in one transfer
    after the optimizer step; micro-batches; real tokens of the micro-batches: under CP the whole
    micro-batch's, ``num_real_tokens`` stays global).

    Raises:
        RuntimeError: the number of micro-batches is not ``accum``.
    """
    sums: dict[str, torch.Tensor] = {}  # on the device: no host sync per loss and micro-batch
    n = tokens = 0
    for mb in micro_batches:
        if captured is not None:
            values = captured(mb, weights.of)
        else:
            with autocast():
                out = model(mb.tokens, mb.cu_seqlens, mb.max_seqlen, mb.labels,
                            ids_checked=getattr(mb, "ids_checked", False))
            loss = compose_loss(out.lm_loss, out.aux_losses, weights)
            (loss / accum).backward()
            values = {"lm_loss": out.lm_loss, **out.aux_losses}
        for name, value in values.items():
            v = value.detach().to(torch.float64)
            sums[name] = sums[name] + v if name in sums else v
        n += 1
        tokens += int(getattr(mb, "num_real_tokens", mb.tokens.numel()))
    if n != accum:
        raise RuntimeError(f"step got {n} micro-batches, expected {accum}")
    return sums, n, tokens



_GRAD_NORM = "\0grad_norm"
"""Key of the gradient norm in the step's one device -> host read (no loss is named so)."""


@dataclass
class PendingStats:
    """A queued step's statistics: its loss sums and gradient norm on their way to the host (:class:`QueuedRead`).

    :meth:`result` waits for that copy only, so the job queues step N + 1 before it reads step N and the GPU
    does not idle while the host logs one step and builds the next one's batch tables. Every rank must call
    :meth:`result` at the same point of its loop (the means are collectives when the job is distributed).
    """

    read: QueuedRead
    pipeline_sums: dict[str, float] | None
    n: int
    tokens: int
    weights: LossWeights
    info: DistInfo
    layout: Layout | None
    cp: int

    def result(self) -> StepStats:
        """The step's :class:`StepStats` (losses averaged over micro-batches and ranks; tokens counted once)."""
        read = self.read.values()
        grad_norm = read.pop(_GRAD_NORM)
        stats = _stats(read if self.pipeline_sums is None else self.pipeline_sums, self.n, self.weights, self.info,
                       self.layout)
        stats.grad_norm = grad_norm
        # every rank of a CP group reports its micro-batches' (global) token count: count them once
        group = self.layout.shard_group if self.layout is not None else None
        ranks = self.layout.shard_size if self.layout is not None else self.info.world
        stats.tokens = round(mean_scalars({"tokens": float(self.tokens)}, self.info, group)["tokens"] * ranks / self.cp)
        return stats


def train_step(model: nn.Module, opt: Optimizers, micro_batches: Iterable[Any], **kwargs: Any) -> StepStats:
    """One step, its statistics read at once: :func:`queue_step` then :meth:`PendingStats.result` (arguments
    and errors as :func:`queue_step`)."""
    return queue_step(model, opt, micro_batches, **kwargs).result()


def queue_step(model: nn.Module, opt: Optimizers, micro_batches: Iterable[Any], *, accum: int,
               weights: LossWeights, grad_clip: float, bias_speed: float, info: DistInfo,
               autocast: Callable[[], contextlib.AbstractContextManager], cp: int = 1,
               pipeline: Any = None, layout: Layout | None = None, experts: frozenset = frozenset(),
               sharded: bool = False, captured: Any = None) -> PendingStats:
    """Forward/backward ``accum`` micro-batches, reduce grads over ranks, clip, step, update router biases;
    the statistics are queued for the host, not read (:class:`PendingStats`).

    Args:
        micro_batches: ``accum`` packed batches (``tokens`` [T], ``labels`` [T], ``cu_seqlens`` [N+1],
            ``max_seqlen``) on the model's device; under CP ``tokens`` / ``labels`` are this rank's
            ``T / cp`` rows and ``cu_seqlens`` the global table.
        accum: micro-batches per step on this rank; every loss term is scaled by 1/accum.
        grad_clip: global L2 norm clip (0 = no clipping; the norm is still reported).
        bias_speed: aux-loss-free router bias speed gamma (expert loads summed over ranks first).
        cp: context-parallel size of the stage (the world holds ``dp = world / cp`` replicas when pp = 1).
        pipeline: this rank's ``PipelineParallel`` (pp > 1; ``model`` is then the rank's parameter view).
        layout: the stage's rank layout (required with ``pipeline``, ``experts`` or ``sharded``: its S,
            pipeline, EP and edp groups).
        experts: the routed-expert parameters this EP rank holds (ep > 1): reduced over the edp group.
        sharded: the other parameters are FSDP2 DTensors whose gradients the backward already reduced.
        captured: the stage's ``graph_step.CapturedStep`` (``compile.cuda_graph``; pp = 1): the micro-batches
            replay it; the graph owns the gradients: zeroed in place after the optimizer step where the micro-batches
            add into them, left for the next replay to overwrite where it writes them (``writes_grads``).
    Raises:
        RuntimeError: the number of micro-batches is not ``accum``.
    """
    model.train()
    on_device: dict[str, torch.Tensor] = {}
    sums = None
    if pipeline is None:
        on_device, n, tokens = accumulate(model, micro_batches, accum=accum, weights=weights, autocast=autocast,
                                          captured=captured)
    else:
        batches = list(micro_batches)
        if len(batches) != accum:
            raise RuntimeError(f"step got {len(batches)} micro-batches, expected {accum}")
        with autocast():
            sums = pipeline.step(batches, weights.of)
        n, tokens = accum, sum(int(getattr(mb, "num_real_tokens", mb.tokens.numel())) for mb in batches)
    params = opt.params
    fill_missing_grads(params)
    norm, clip = _reduce_and_clip(params, info, layout, dp=layout.dp if layout is not None else info.world // cp,
                                  max_norm=grad_clip if grad_clip > 0 else math.inf, experts=experts,
                                  sharded=sharded)
    opt.step(clip=clip)
    if captured is None:
        opt.zero_grad()
    elif not captured.writes_grads:  # the graph adds into these very tensors at the next replay
        opt.zero_grad(set_to_none=False)
    group = layout.shard_group if layout is not None else None
    sum_tensors([m.expert_counts for m in model.modules() if hasattr(m, "expert_counts")], info, group)
    model.update_router_bias(bias_speed)
    # the step's one copy of device values to the host, queued after everything else: the host never waits mid-step
    read = QueuedRead({**on_device, _GRAD_NORM: norm.detach()})
    return PendingStats(read=read, pipeline_sums=sums, n=n, tokens=tokens, weights=weights, info=info, layout=layout,
                        cp=cp)


def _reduce_and_clip(params: list[torch.Tensor], info: DistInfo, layout: Layout | None, *, dp: int,
                     max_norm: float, experts: frozenset, sharded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients to ``(1/dp) · Σ_S g`` (docs/parallelism.md "Rank grid"), then the global norm and its clip.

    Unsharded parameters: one flat all-reduce over the S group (the world when pp = 1); routed experts
    under EP: over the edp group (the ranks holding the same experts); FSDP-sharded ones were
    reduce-scattered by the backward. The norm sums sharded squares over their mesh, expert squares
    over the EP group and every pipeline rank's share (``data_parallel.grad_norm``).
    Returns: the norm (0-d tensor, the same on every rank) and the clip coefficient
    ``min(1, max_norm / (norm + 1e-6))`` (None when ``max_norm`` is inf), which ``Optimizers.step`` applies.
    """
    group = layout.shard_group if layout is not None else None
    if not sharded:
        average_grads([p for p in params if p not in experts], info, dp=dp, group=group)
    if experts:
        reduce_gradients([p for p in params if p in experts], layout.edp_group, dp)
    norm = grad_norm(params, expert_params=experts, ep_group=layout.ep_group if experts else None,
                     pp_group=layout.pipe_group if layout is not None else None)
    return norm, clip_coefficient(norm, max_norm) if math.isfinite(max_norm) else None


def without_compiling() -> contextlib.AbstractContextManager:
    """Compiled blocks run their eager code inside (``torch.compiler.set_stance("force_eager")``; nothing on a
    torch without stances). For the held-out evaluation: a few no-grad forwards per stage, whose no-grad graphs
    took 84 s to compile at a stage end of recipes/bench_h200.yaml on an H200 (benchmarks/results/train_step_h200.md)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Any], info: DistInfo,
             autocast: Callable[[], contextlib.AbstractContextManager], pipeline: Any = None,
             layout: Layout | None = None) -> dict[str, float]:
    """Mean held-out LM loss (nats/token) over ``batches`` (averaged over ranks; under CP every rank of a
    CP group holds the same global value, so the world mean is the mean over DP replicas). Under PP the
    last stage computes it (forward-only schedule) and the pipeline group shares it. Compiled blocks run
    eagerly here (:func:`without_compiling`)."""
    with without_compiling():
        return _evaluate(model, batches, info, autocast, pipeline, layout)


def _evaluate(model: nn.Module, batches: Iterable[Any], info: DistInfo,
              autocast: Callable[[], contextlib.AbstractContextManager], pipeline: Any,
              layout: Layout | None) -> dict[str, float]:
    model.eval()
    sums: dict[str, float] = {}
    total: torch.Tensor | None = None  # on the device: one host read after the loop
    n = 0
    if pipeline is not None:
        batches = list(batches)
        with autocast():
            sums = {k: v for k, v in pipeline.evaluate(batches).items() if k == "lm_loss"}
        n = len(batches)
    else:
        layout = None
        for mb in batches:
            with autocast():
                out = model(mb.tokens, mb.cu_seqlens, mb.max_seqlen, mb.labels,
                            ids_checked=getattr(mb, "ids_checked", False))
            loss = out.lm_loss.detach().to(torch.float64)
            total = loss if total is None else total + loss
            n += 1
        sums = to_host({"lm_loss": total}) if total is not None else {}
    model.train()
    if n == 0:
        return {}
    return _reduced_means(sums, n, info, layout)
