"""Pipeline parallelism: stages from ``parallel.pp_layout``, run by torch.distributed.pipelining.

docs/parallelism.md "Pipeline parallel". Virtual stage ``i`` of the parsed layout
(``validators/layout.py``) runs on pipeline rank ``i % pp`` as its local stage ``i // pp``.
Each stage is a :class:`StagePart`: the single-device :class:`~v4launch.model.V4Model` with
the layers and top-level modules of other stages removed (``None``), sharing the modules it
keeps with the model it was cut from, so parameter FQNs are unchanged
(``layers.7.attn.wq_a.weight``) and DCP checkpoints reshard across layouts (torchtitan's
``pipeline_module_split``, written here for the V4 forward pieces).

What crosses a stage boundary (one tensor per entry, this rank's rows T under CP):

* ``h`` [T, hc, dim]: the mHC streams;
* ``e`` [depth, T, dim]: embeddings of the MTP-shifted tokens (only when the model has MTP;
  computed on the first stage so the last one needs no copy of ``embed``, and carried
  unchanged through the stages in between; their gradient flows back to ``embed``).

Batch metadata (tokens, labels, cu_seqlens, max_seqlen) never travels: every rank of a
pipeline group loads the same micro-batches into a :class:`MicroBatchTable`, and the schedule
passes each stage only the micro-batch index (keyword ``mb``, a [1] int64 tensor).

Losses (the single-device step backpropagates ``(lm + Σ w·aux) / accum`` per micro-batch):
the last stage returns ``lm + Σ w·aux`` of its own layers as the schedule's loss; a non-last
stage attaches ``Σ w·aux`` of its layers to its outputs with :class:`AuxGrad` (identity
forward; backward adds d(Σ w·aux)), so the aux gradients reach the owning stage's parameters
in the same backward. The schedule divides every gradient by the micro-batch count
(``scale_grads``), which is the 1/accum. Raw loss values are summed per name into the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ...validators.layout import parse_layout, structure_problems
from ..common import to_host
from ..model import V4Model


@dataclass(frozen=True)
class StageSpec:
    """One virtual stage of the layout.

    Attributes:
        index: virtual stage index (0 .. n_stages - 1, layer order).
        n_stages: pp · vpp.
        pp_rank: pipeline rank that runs it (``index % pp``).
        layer_ids: decoder layers it runs, in order (global ids).
        has_embed / has_mtp / has_loss: it holds ``E`` / the ``m`` layers / ``L``.
    """

    index: int
    n_stages: int
    pp_rank: int
    layer_ids: tuple[int, ...]
    has_embed: bool
    has_mtp: bool
    has_loss: bool

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1


def stage_specs(pp_layout: str, pp: int, vpp: int, n_layers: int, n_mtp_layers: int) -> list[StageSpec]:
    """Every virtual stage of ``pp_layout`` for ``pp`` ranks × ``vpp`` virtual stages.

    Raises:
        ValueError: the layout does not parse or fails ``validators.layout.structure_problems``
            (stage count, one E first, one L last, t = n_layers, m = mtp depth); or the MTP
            layers ``m`` are not on the same (last) virtual stage as ``L`` (the stage that
            computes the MTP losses needs the final streams and the head).
    """
    layout = parse_layout(pp_layout)
    problems = structure_problems(layout, pp, vpp, n_layers, n_mtp_layers)
    where = f"parallel.pp_layout={pp_layout!r} (pp={pp}, vpp={vpp})"
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems) + ". Fix: run `v4launch validate` and use its layout.")
    if n_mtp_layers and "m" not in layout.stages[-1]:
        raise ValueError(f"{where}: the MTP layers 'm' must sit on the last virtual stage, with 'L'. "
                         "Fix: move every 'm' into the last stage, e.g. '...|t*4mL'.")
    specs, next_layer = [], 0
    for i, symbols in enumerate(layout.stages):
        ids = tuple(range(next_layer, next_layer + symbols.count("t")))
        next_layer += len(ids)
        specs.append(StageSpec(index=i, n_stages=len(layout.stages), pp_rank=i % pp, layer_ids=ids,
                               has_embed="E" in symbols, has_mtp="m" in symbols, has_loss="L" in symbols))
    return specs


@dataclass
class MicroBatchTable:
    """The micro-batches of one step (or evaluation) as every rank of a pipeline group holds them.

    ``batches[i]``: object with ``tokens`` [T], ``labels`` [T], ``cu_seqlens`` [N+1], ``max_seqlen``
    (this rank's CP slice). ``weight_of(name)``: coefficient of aux loss ``name`` (training only).
    ``sums``: raw loss values summed over micro-batches, per name, for the stages this rank runs
    (``lm_loss`` and the MTP losses on the last stage).
    """

    batches: list[Any] = field(default_factory=list)
    weight_of: Optional[Callable[[str], float]] = None
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def record(self, name: str, value: torch.Tensor) -> None:
        """Add the 0-d loss ``value`` to ``sums[name]`` on the device (float64, detached): no host sync."""
        v = value.detach().to(torch.float64)
        self.sums[name] = self.sums[name] + v if name in self.sums else v



class AuxGrad(torch.autograd.Function):
    """``AuxGrad.apply(aux, *outs) -> outs``: identity forward; backward also sends gradient 1 into ``aux``.

    ``aux`` is the 0-d weighted auxiliary loss of a non-last stage; the gradient it then
    accumulates on the stage's parameters is ``d aux`` per micro-batch, like the LM loss's
    (the schedule scales both by 1 / micro-batches). ``outs``: the stage's output activations.
    """

    @staticmethod
    def forward(ctx, aux: torch.Tensor, *outs: torch.Tensor):  # noqa: D102
        ctx.aux_meta = (aux.dtype, aux.device)
        # copies, not views: an FSDP-wrapped stage attaches its pre-backward hook to its outputs,
        # which a later in-place op on a view would drop (one activation copy per micro-batch)
        return tuple(o.clone() for o in outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: D102
        dtype, device = ctx.aux_meta
        return (torch.ones((), dtype=dtype, device=device), *grads)


class StagePart(V4Model):
    """One pipeline stage: a :class:`V4Model` holding only the stage's modules, with a stage forward.

    Built by :func:`cut_stage` (never by ``__init__``). ``forward(*acts, mb)`` reads
    micro-batch ``int(mb)`` from :attr:`table`; ``acts`` are the previous stage's ``(h[, e])``
    (the first stage gets the index tensor instead). Returns ``(h[, e])`` cast to
    :attr:`act_dtype`, or on the last stage the 0-d loss ``lm + Σ w·aux`` of its layers.
    """

    spec: StageSpec
    table: MicroBatchTable
    act_dtype: torch.dtype

    def forward(self, *acts: torch.Tensor, mb: torch.Tensor):  # type: ignore[override]
        batch = self.table.batches[int(mb.reshape(-1)[0])]
        tokens, labels = batch.tokens, batch.labels
        ctx = self.batch_context(tokens, batch.cu_seqlens, batch.max_seqlen, labels,
                                 ids_checked=getattr(batch, "ids_checked", False))
        aux: dict[str, torch.Tensor] = {}
        if self.spec.has_embed:
            h, e = self.embed_streams(tokens, ctx, with_mtp=True)
        else:
            h, e = acts[0], (acts[1] if len(acts) > 1 else None)
        h = self.run_layers(h, tokens, ctx, aux)
        if self.spec.has_loss:
            lm, _ = self.head_losses(h, e, tokens, labels, ctx, aux)
            self.table.record("lm_loss", lm)
            for name in sorted(aux):
                self.table.record(name, aux[name])
            return lm + self._weighted(aux) if aux else lm
        for name in sorted(aux):
            self.table.record(name, aux[name])
        outs = tuple(t.to(self.act_dtype) for t in ((h,) if e is None else (h, e)))
        if aux and torch.is_grad_enabled():
            outs = AuxGrad.apply(self._weighted(aux), *outs)
        return outs if len(outs) > 1 else outs[0]

    def _weighted(self, aux: dict[str, torch.Tensor]) -> torch.Tensor:
        """``Σ weight(name) · aux[name]`` in sorted name order (0 weights in evaluation)."""
        weight = self.table.weight_of or (lambda name: 0.0)
        names = sorted(aux)
        total = weight(names[0]) * aux[names[0]]
        for name in names[1:]:
            total = total + weight(name) * aux[name]
        return total


_MODULE_STATE = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping attributes


def cut_stage(model: V4Model, spec: StageSpec, cls: type[V4Model] = StagePart) -> V4Model:
    """A ``cls`` instance sharing ``model``'s modules that ``spec`` runs; the others are ``None``.

    The cut shares parameters with ``model`` (no copy): each module belongs to exactly one
    stage. ``layers`` keeps the stage's layer ids as keys, so FQNs are the single-device ones.
    Plain attributes (args, phase, cp, chunk_size, kernel backend) are copied.
    """
    from ..model import LayerDict

    part = cls.__new__(cls)
    nn.Module.__init__(part)
    for key, value in vars(model).items():
        if key not in _MODULE_STATE:
            object.__setattr__(part, key, dict(value) if isinstance(value, dict) else value)
    part.training = model.training
    part.embed = model.embed if spec.has_embed else None
    part.layers = LayerDict({str(i): model.layers[i] for i in spec.layer_ids})
    keep_head = spec.has_loss
    part.norm, part.head = (model.norm, model.head) if keep_head else (None, None)
    part.mtp = model.mtp if spec.has_mtp else None
    for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
        setattr(part, name, getattr(model, name) if keep_head else None)
    return part


def activation_shapes(model: V4Model, rows: int) -> list[tuple[int, ...]]:
    """Shapes of the tensors between stages: ``[(rows, hc, dim)]`` plus ``(depth, rows, dim)`` with MTP."""
    a = model.args
    shapes = [(rows, a.hc_mult, a.dim)]
    if a.n_mtp_layers:
        shapes.append((a.n_mtp_layers, rows, a.dim))
    return shapes


def local_specs(specs: Sequence[StageSpec], pp_rank: int) -> list[StageSpec]:
    """The virtual stages pipeline rank ``pp_rank`` runs, in order."""
    return [s for s in specs if s.pp_rank == pp_rank]


class PipelineParallel:
    """This rank's pipeline stages and the torch.distributed.pipelining schedules that run them.

    Args:
        parts: this rank's :class:`StagePart` s (one per local virtual stage, in order).
        specs: their :class:`StageSpec` s (same order).
        group: the pipeline process group (one rank per pipeline rank, pipeline-rank order).
        device: where activations live.
        act_dtype: dtype of the tensors sent between stages (the model's parameter dtype).

    Schedules (built per micro-batch count and row count and reused; one for training and one for
    evaluation are kept): ``Schedule1F1B``
    (one stage per rank) or ``ScheduleInterleaved1F1B`` for training, ``ScheduleGPipe`` /
    ``ScheduleLoopedBFS`` forward-only for evaluation. Stage metadata is static (shapes from
    :func:`activation_shapes`), so no forward runs to infer it.
    """

    def __init__(self, parts: Sequence[StagePart], specs: Sequence[StageSpec], group: Any, device: torch.device,
                 act_dtype: torch.dtype) -> None:
        self.parts, self.specs, self.group, self.device = list(parts), list(specs), group, device
        self.act_dtype = act_dtype
        self.table = MicroBatchTable()
        for part, spec in zip(self.parts, self.specs):
            part.spec, part.table, part.act_dtype = spec, self.table, act_dtype
        self._schedules: dict[tuple[int, int, bool], Any] = {}

    @property
    def has_first(self) -> bool:
        return self.specs[0].is_first

    @property
    def has_last(self) -> bool:
        return self.specs[-1].is_last

    def _stage(self, part: StagePart, spec: StageSpec, rows: int) -> Any:
        from torch.distributed.pipelining import PipelineStage

        def meta(shape, dtype=self.act_dtype, grad=True):
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

        acts = tuple(meta(s) for s in activation_shapes(part, rows))
        inputs = (meta((1,), torch.int64, False),) if spec.is_first else acts
        outputs = (meta((), self.act_dtype),) if spec.is_last else acts
        return PipelineStage(part, spec.index, spec.n_stages, self.device, input_args=inputs, output_args=outputs,
                             group=self.group)

    def _schedule(self, n_microbatches: int, rows: int, train: bool) -> Any:
        from torch.distributed import pipelining as pl

        key = (n_microbatches, rows, train)
        if key not in self._schedules:
            for old in [k for k in self._schedules if k[2] == train]:  # one per kind: free the old buffers
                del self._schedules[old]
            stages = [self._stage(p, s, rows) for p, s in zip(self.parts, self.specs)]
            loss_fn = (lambda out, target: out) if train else None
            if len(stages) == 1:
                cls = pl.Schedule1F1B if train else pl.ScheduleGPipe
                self._schedules[key] = cls(stages[0], n_microbatches, loss_fn=loss_fn)
            else:
                cls = pl.ScheduleInterleaved1F1B if train else pl.ScheduleLoopedBFS
                self._schedules[key] = cls(stages, n_microbatches, loss_fn=loss_fn)
        return self._schedules[key]

    def _run(self, batches: Sequence[Any], train: bool) -> dict[str, float]:
        self.table.batches, self.table.sums = list(batches), {}
        n = len(batches)
        index = torch.arange(n)  # on the host: each stage reads its micro-batch number without a device sync
        schedule = self._schedule(n, int(batches[0].tokens.numel()), train)
        args = (index,) if self.has_first else ()
        target = torch.zeros(n) if (train and self.has_last) else None  # unused by the loss; the schedule wants one
        schedule.step(*args, target=target, return_outputs=False, mb=index)
        return to_host(self.table.sums)  # one device -> host transfer

    def step(self, batches: Sequence[Any], weight_of: Callable[[str], float]) -> dict[str, float]:
        """Forward + backward of ``batches`` (the step's micro-batches) through the pipeline.

        Every parameter gradient of this rank's stages accumulates ``(1/n) Σ_mb d(lm + Σ w·aux)``
        (n = len(batches)), as the single-device step. Returns this rank's raw loss sums per name.

        Raises:
            ValueError: (from the schedule) fewer micro-batches than the schedule needs
                (1F1B: at least pp).
        """
        self.table.weight_of = weight_of
        return self._run(batches, True)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Any]) -> dict[str, float]:
        """Forward-only pass of ``batches``; returns this rank's raw loss sums (``lm_loss`` on the last stage)."""
        self.table.weight_of = None
        return self._run(batches, False) if batches else {}
