"""Elementwise chains compiled on their own on CUDA: the mHC mixing, RMSNorm and RoPE of an eager step.

A step that is not compiled as a whole (``compile.enable`` off, as the Flash recipes run) would run each of
these chains as a handful of eager kernels with float32 intermediates the size of the activations: RMSNorm's
upcast, square, mean, two broadcast multiplies and the cast back; RoPE's upcast, four multiplies, stack and
cat. At Flash width they are most of the sparse step's "elementwise and other" time (57% of 3.9 s on the H200,
benchmarks/results/flash_width_h200_2026-12-04.md: 522 broadcasting float32 multiplies, ~470 ms of copies).
Compiled, each chain is one or two fused kernels reading its inputs once.

How a chain is compiled (:func:`compile_rows_dynamic`): whole (``fullgraph``), the row dimension (dim 0 =
tokens, entries or segments) dynamic so one graph serves every batch, and every other dimension static. All
dynamic (``dynamic=True``) leaves hc, dim and head_dim as symbols: inductor then cannot unroll short sums and
indexes with symbolic div/mod (the mHC stream sum ran ~15x slower than the pointwise kernel it should be).

Inside a region already being compiled (a compiled Block) :func:`run` calls the plain function, which that
region fuses. On the CPU, in float64 and with :func:`set_fused_regions` (False) the callers run their eager code.
"""

from __future__ import annotations

from typing import Callable

import torch

_STATE: dict = {"on": True, "built": {}, "backend": "inductor"}

RECOMPILE_LIMIT = 64
"""dynamo's per-function cache entries the regions allow (its default is 8). One function serves several static
shapes: RMSNorm alone runs at dim, q_lora_rank, head_dim and the indexer's head_dim, in bf16 and float32, with and
without gradients (evaluation); past the limit dynamo would run it eagerly."""


def set_fused_regions(enabled: bool) -> None:
    """Turn the compiled RMSNorm / RoPE regions on CUDA on (default) or off (eager everywhere). The mHC mixing
    has its own switch (``mhc.set_fused_mixing``)."""
    _STATE["on"] = bool(enabled)


def fused_here(t: torch.Tensor) -> bool:
    """Whether the compiled regions run for ``t``: the switch on, a CUDA tensor, not float64 (parity runs)."""
    return _STATE["on"] and t.is_cuda and t.dtype != torch.float64


def compile_rows_dynamic(fn: Callable, row_args: tuple[int, ...], backend: str | object = "inductor") -> Callable:
    """``fn`` compiled whole with dim 0 of the arguments at ``row_args`` dynamic and every other dimension static.

    Returns a callable with ``fn``'s signature that marks those rows dynamic (``torch._dynamo.maybe_mark_dynamic``:
    a row count of 0 or 1 may still specialise) before each call. Python scalars (eps, flags) are constants of the
    graph. ``backend``: torch.compile's (tests pass others). Raises what torch.compile raises on a first call.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)

    def call(*args):
        for i in row_args:
            torch._dynamo.maybe_mark_dynamic(args[i], 0)
        return compiled(*args)

    return call


def run(fn: Callable, row_args: tuple[int, ...], *args):
    """``fn(*args)`` through its compiled region (:func:`compile_rows_dynamic`, built on first use and kept per
    function), or ``fn`` itself inside a region dynamo is already compiling."""
    if torch.compiler.is_compiling():
        return fn(*args)
    built = _STATE["built"]
    if fn not in built:
        built[fn] = compile_rows_dynamic(fn, row_args, _STATE["backend"])
    return built[fn](*args)
