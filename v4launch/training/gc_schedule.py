"""``run.gc_interval_steps``: Python's cyclic garbage collector on the training loop's schedule, not its own.

CPython runs a full (generation 2) collection when enough objects have survived the younger ones; it walks every
tracked object, and a training process holds many (the model, the optimizer state's Python side, and with
``compile.enable`` dynamo's caches, FX graphs and inductor's kernels). On the CPU, a 60-step run of
recipes/tiny_cpu.yaml had 7 full collections of up to 240 ms (mean 128 ms; ``gc.callbacks``). With
``compile.cuda_graph`` a step's host work is a few ms, so such a pause can be a slow step, and across ranks one
rank's pause stalls the collectives of all. (The slow logging intervals of the H200 product run once put down to
it were padded steps: with ``data.packing: fill_rows`` and automatic collection they were gone; docs/training.md
"Garbage collection".)

With ``gc_interval_steps`` > 0 the job turns automatic collection off while it trains, collects the young
generations (``gc.collect(1)``: the objects of the last steps, a few ms) every ``gc_interval_steps`` steps, and
runs a full collection where the job is not timing steps: at its start, at each stage end (before the held-out
evaluation) and before a checkpoint (the same policy as torchtitan's ``training.gc_freq``). ``0``, the default,
leaves Python's automatic collection on: no GPU run has shown a step that the schedule makes faster.
(A dynamo failure once blamed on it came from test order: ``parallelize`` now resets dynamo before compiling.)
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


class GarbageCollection:
    """When the training job collects garbage.

    Args:
        interval_steps: optimizer steps between young-generation collections; 0: Python's automatic collection.
    Raises:
        ValueError: a negative interval (the schema refuses it first: ``run.gc_interval_steps`` >= 0).
    """

    def __init__(self, interval_steps: int) -> None:
        if interval_steps < 0:
            raise ValueError(f"run.gc_interval_steps = {interval_steps}: must be >= 0 (0: Python's automatic "
                             "collection). Fix: set it to 0 or a step count such as 50")
        self.interval_steps = interval_steps

    def describe(self) -> str:
        """One sentence for the job's log."""
        if not self.interval_steps:
            return "garbage collection: Python's automatic collection (run.gc_interval_steps=0)"
        return (f"garbage collection: automatic collection off while training; young generations every "
                f"{self.interval_steps} steps, a full collection at stage ends and before checkpoints")

    @contextlib.contextmanager
    def during_training(self) -> Iterator[None]:
        """Automatic collection off for the body (after one full collection), restored as it was on exit,
        also after an exception."""
        if not self.interval_steps:
            yield
            return
        was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()

    def after_step(self, step: int) -> None:
        """The young-generation collection when ``step`` (optimizer steps done) is a multiple of the interval."""
        if self.interval_steps and step % self.interval_steps == 0:
            gc.collect(1)

    def full(self) -> None:
        """A full collection where no step is being timed (stage end, checkpoint)."""
        if self.interval_steps:
            gc.collect()
