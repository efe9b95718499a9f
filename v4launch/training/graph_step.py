"""``compile.cuda_graph``: one micro-batch's forward and backward captured once per stage in a CUDA graph and
replayed for every micro-batch after it.

Without a graph the step of a small model is host-bound: on one H200 the benchmark model's compiled step
spent ~225 ms of host time per step against ~165 ms of GPU time (benchmarks/results/train_step_h200.md). A
replay launches the whole forward and backward with one call.

What makes a product batch replayable: every shape a step allocates is fixed by the stage, not by the
batch. ``V4Model.batch_context(..., static_seqlen=seq_len)`` builds the tables with T segment rows, the
stage's ``seq_len`` as the length bound and ``T // ratio`` compressed entries per ratio
(``model/packing.py`` ``pad_pack``; the same losses and gradients as the exact tables,
tests/model/test_static_batch.py). Each micro-batch's tables are built eagerly (the id check and the
boundary read stay on the host, outside the graph), copied into the captured ones (``BatchContext.load``)
with the tokens and labels, and the graph replays.

Around the graph, eagerly: the gradient reduction over data-parallel replicas, the clip, the optimizer and
the router-bias update (``step.train_step``). The ``.grad`` tensors are the graph's own:

* one micro-batch per step (``accum == 1``): the capture starts with every ``.grad`` None, so the captured
  backward allocates the gradients and writes them (autograd's first accumulation takes the gradient as it
  is). Each replay overwrites them: no zeroing kernel after the step and no read-add-write per parameter in
  the backward (on one H200, recipes/bench_h200.yaml: 934 float32 add kernels, 5.6 ms, and a 1.2 ms
  zero_grad per sparse step, benchmarks/results/product_run_h200.md "2026-12-03 (2)").
* several micro-batches: they accumulate in place into the ``.grad`` tensors the graph captured, so the step
  zeroes them in place (``Optimizers.zero_grad(set_to_none=False)``).

Nothing may replace those tensors while the stage runs (a replay would write where no parameter reads):
each replay checks, and :meth:`CapturedStep.release` drops them when the stage ends, so that the next stage
starts from no gradient. The loss weights are device scalars filled before each replay (the MTP weight
drops when the LR decays).

Stages that read the host inside the step (the reference and cudnn kernels) run eagerly; the warm-up's
dense KL on triton does not (its query chunks come from host ints, ``model/kernels/layer.static_chunks``).
``validators/derived.py`` ``graph_free_reason`` decides, and the validator (rule V4-CUDA-GRAPH), the memory
plan and the job all use it.
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn

from ..errors import V4LaunchError
from ..validators.derived import graph_free_reason
from .step import compose_loss


class CaptureError(V4LaunchError):
    """The step could not be captured (something in it synchronises with the host or changes shape)."""


class CapturedStep:
    """Forward + backward of one micro-batch of a stage, captured at the first call and replayed after.

    Args:
        model: the single-device ``V4Model`` (its phase and kernels fixed for the stage).
        seq_len: the stage's row length (the bound on any segment): tokens per micro-batch T = rows · seq_len.
        accum: micro-batches per step (the loss is scaled by 1/accum, as ``step.accumulate``).
        autocast: the step's autocast context factory.
        warmup: eager forward/backward passes on a side stream before the capture (compiling, Triton's
            first launches, the autograd graph's first allocation of every ``.grad``); their gradients and
            expert counts are discarded.
        report: where a failed capture writes its whole exception chain (the message names the file).
    """

    def __init__(self, model: nn.Module, *, seq_len: int, accum: int,
                 autocast: Callable[[], contextlib.AbstractContextManager], warmup: int = 2,
                 report: Path | None = None) -> None:
        self.model, self.seq_len, self.accum, self.autocast, self.warmup = model, seq_len, accum, autocast, warmup
        self.report = report
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ctx: Any = None
        self.tokens = self.labels = None
        self.weights: dict[str, torch.Tensor] | None = None
        self.outputs: dict[str, torch.Tensor] = {}
        self.writes_grads = accum == 1
        """The replay writes the gradients (one micro-batch per step): the step must not zero them."""
        self._grads: list[tuple[nn.Parameter, torch.Tensor]] = []

    def release(self) -> None:
        """The stage's end: every parameter's ``.grad`` captured by the graph is dropped (None), so that the next
        stage's first backward starts from no gradient (a written-gradient graph leaves the last step's there)."""
        for p, _ in self._grads:
            p.grad = None
        self._grads = []

    def __call__(self, mb: Any, loss_weight: Callable[[str], float]) -> dict[str, torch.Tensor]:
        """Run micro-batch ``mb`` (``tokens`` / ``labels`` [T] on the GPU, ``cu_seqlens`` [N+1], ``max_seqlen``):
        its gradients are written to ``.grad`` (``writes_grads``: one micro-batch per step) or added to them.
        Returns the raw losses by name (``lm_loss`` and the aux losses, 0-d tensors owned by the graph: read or
        copy them before the next call).

        Raises:
            ValueError: a batch of another T, or a segment longer than ``seq_len``.
            CaptureError: the first call could not capture the step, or a parameter's gradient is no longer the
                tensor the graph captured.
        """
        ctx = self.model.batch_context(mb.tokens, mb.cu_seqlens, mb.max_seqlen, mb.labels,
                                       static_seqlen=self.seq_len, ids_checked=getattr(mb, "ids_checked", False))
        if self.graph is None:
            self._capture(mb, ctx, loss_weight)
        else:
            if mb.tokens.shape != self.tokens.shape:
                raise ValueError(f"captured step: a micro-batch of {mb.tokens.numel()} tokens, the graph holds "
                                 f"{self.tokens.numel()}. Fix: one micro-batch size and seq_len per stage")
            self._check_grads()
            self.ctx.load(ctx)
            self.tokens.copy_(mb.tokens, non_blocking=True)
            self.labels.copy_(mb.labels, non_blocking=True)
        self._fill_weights(loss_weight)
        self.graph.replay()
        return self.outputs

    def _check_grads(self) -> None:
        """Every parameter still holds the gradient tensor the graph writes (or adds) into.

        Raises:
            CaptureError: one was replaced or dropped since the capture (``zero_grad()`` with its default
                ``set_to_none=True``, a reassignment): replaying would leave that parameter's gradient stale.
        """
        for p, g in self._grads:
            if p.grad is not g:
                name = next((n for n, q in self.model.named_parameters() if q is p), "?")
                raise CaptureError(f"compile.cuda_graph: the gradient of {name} is no longer the tensor the "
                                   "captured step writes into (it was replaced or set to None after the capture)",
                                   hint="zero a captured step's gradients in place (zero_grad(set_to_none=False)) "
                                        "and only where CapturedStep.writes_grads is false")

    def _fill_weights(self, loss_weight: Callable[[str], float]) -> None:
        for name, w in self.weights.items():
            w.fill_(loss_weight(name))

    def _forward_backward(self, loss_weight: Callable[[str], float]) -> dict[str, torch.Tensor]:
        with self.autocast():
            out = self.model.forward_in(self.ctx, self.tokens, self.labels)
        if self.weights is None:  # the aux-loss names are known after the first forward
            self.weights = {n: torch.zeros((), dtype=v.dtype, device=v.device) for n, v in out.aux_losses.items()}
            self._fill_weights(loss_weight)
        total = compose_loss(out.lm_loss, out.aux_losses, SimpleNamespace(of=self.weights.__getitem__))
        (total / self.accum).backward()
        return {"lm_loss": out.lm_loss.detach(), **{n: v.detach() for n, v in out.aux_losses.items()}}

    def _warm_up(self, loss_weight: Callable[[str], float]) -> None:
        """The eager passes before the capture, each starting as the capture will: without RoPE tables (built
        inside the pass). A compiled block whose guards read the caches or a first-use probe then meets, and
        compiles for, the capture's state here; compiled inside the capture it would fail it."""
        for _ in range(self.warmup):
            self.ctx._rope.clear()
            self._forward_backward(loss_weight)

    def _capture(self, mb: Any, ctx: Any, loss_weight: Callable[[str], float]) -> None:
        self.ctx, self.tokens, self.labels = ctx, mb.tokens.clone(), mb.labels.clone()
        counts = [m.expert_counts for m in self.model.modules() if hasattr(m, "expert_counts")]
        kept = [c.clone() for c in counts]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                self._warm_up(loss_weight)
            torch.cuda.current_stream().wait_stream(side)
            with torch.no_grad():  # the warm-ups' gradients and expert counts are not this step's
                for p in self.model.parameters():
                    if self.writes_grads:
                        p.grad = None  # the captured backward allocates and writes them
                    elif p.grad is not None:
                        p.grad.zero_()
                for c, k in zip(counts, kept):
                    c.copy_(k)
            self.ctx._rope.clear()  # built inside the capture, so that every replay rebuilds them
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of the job's other threads (compile workers, the data loader) during the
            # capture do not invalidate it; this thread's own unsafe calls still fail it
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), no_compiling():
                self.outputs = self._forward_backward(loss_weight)
            self._grads = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        except RuntimeError as exc:
            self.graph = None
            saved = ""
            if self.report is not None:
                self.report.parent.mkdir(parents=True, exist_ok=True)
                self.report.write_text("".join(traceback.format_exception(exc)))
                saved = f"; the whole exception chain is in {self.report}"
            raise CaptureError(f"compile.cuda_graph: capturing the step failed: {_first_failure(exc)}{saved}",
                               hint="set compile.cuda_graph=false (the stage then runs eagerly) and report the "
                                    "message: the validator admitted this stage for capture (a 'recompile' "
                                    "failure: rerun with TORCH_LOGS=recompiles, which names the failed guard)") from exc


def no_compiling() -> contextlib.AbstractContextManager:
    """Compiling inside a capture fails it with a CUDA error that names no cause (inductor's passes run kernels
    and synchronise): under this, a compiled block whose guards the warm-up did not satisfy raises dynamo's
    error instead, which names the failed guard."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("fail_on_recompile") if stance is not None else contextlib.nullcontext()


def _first_failure(exc: BaseException) -> str:
    """The error that broke the capture (the first of a chain: later ones only say the capture was invalidated)
    and the innermost model or job frame that raised it."""
    while exc.__context__ is not None and isinstance(exc.__context__, Exception):
        exc = exc.__context__
    where = [f for f in traceback.extract_tb(exc.__traceback__) if "v4launch" in f.filename]
    place = ""
    if where:
        path = Path(where[-1].filename)
        place = f" (at {path.parent.name}/{path.name}:{where[-1].lineno} {where[-1].name})"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}{place}"


def stage_graph_plan(recipe: Any, plan: Any, running_backend: str, device: torch.device) -> tuple[bool, str]:
    """(capture this stage's step?, the sentence the job logs). The decision of rule V4-CUDA-GRAPH, on what the
    job actually runs: the backend the device runs (not only the requested one)."""
    if not recipe.compile.cuda_graph:
        return False, ""
    if device.type != "cuda":
        return False, f"compile.cuda_graph: stage {plan.name} runs without a graph: the device is {device.type}"
    reason = graph_free_reason(running_backend)
    if reason:
        return False, f"compile.cuda_graph: stage {plan.name} runs without a graph: {reason}"
    return True, f"compile.cuda_graph: stage {plan.name} captures one micro-batch step and replays it"
