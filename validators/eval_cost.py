"""What the held-out evaluation costs: how often it runs, the token rows it reads, its share of step time.

The job (``v4launch/training/runner.py``) evaluates the held-out LM loss at every stage end and, with
``logging.eval_interval_steps`` = N > 0, after every N-th step of a stage (the stage's own step count, which
restarts at 0 in each stage and is saved in every checkpoint, so a resumed run evaluates at the same steps),
except the stage's last step, whose evaluation is the stage-end one. Each evaluation is forward only (no
gradients, no optimizer step) over the first :data:`EVAL_MICRO_BATCHES` micro-batches of the held-out split in
dataset order (``data_io.eval_batches``): the same documents every time, at the stage's ``seq_len`` and
``micro_batch_size``, dealt round-robin over the data-parallel replicas.

Memory: an evaluation holds no activations for a backward and no new gradients, so its peak stays under the
training step's at the same micro-batch shape; the memory plan needs no term for it. Time: the functions below
give the count and a step-time fraction, which a time estimate multiplies by the stage's step time.
Pure arithmetic: never imports torch.
"""

from __future__ import annotations

EVAL_MICRO_BATCHES = 8
"""Held-out micro-batches one evaluation reads in all (at least one per data-parallel replica)."""

FORWARDS_PER_TRAINING_MICRO_BATCH = 3
"""A training micro-batch costs about 3 forwards (forward + backward at twice the forward's FLOPs);
whole-layer recompute adds one more."""


def evaluations(steps: int, interval: int) -> int:
    """Held-out evaluations in a stage of ``steps`` optimizer steps: one at its end, plus one after every
    ``interval``-th step before its last (``interval`` 0: none). Raises ValueError for steps < 1 or interval < 0."""
    if steps < 1 or interval < 0:
        raise ValueError(f"evaluations(steps={steps}, interval={interval}): steps >= 1 and interval >= 0 are required")
    return 1 + ((steps - 1) // interval if interval else 0)


def micro_batches_per_replica(dp: int) -> int:
    """Held-out micro-batches each data-parallel replica runs per evaluation: ceil(EVAL_MICRO_BATCHES / dp)."""
    if dp < 1:
        raise ValueError(f"micro_batches_per_replica(dp={dp}): dp >= 1 is required")
    return -(-EVAL_MICRO_BATCHES // dp)


def eval_token_rows(dp: int, micro_batch: int, seq_len: int) -> int:
    """Token rows (tokens, whole-document packing with its padding) one evaluation runs forward over, all
    replicas together: ``micro_batches_per_replica(dp) * dp * micro_batch * seq_len``."""
    return micro_batches_per_replica(dp) * dp * micro_batch * seq_len


def eval_step_fraction(dp: int, accum: int, *, recompute: bool = False) -> float:
    """One evaluation's time as a fraction of one training step of the stage (``accum`` micro-batches per
    replica, each about 3 forwards, 4 under whole-layer recompute), ignoring pipeline bubbles and the
    optimizer step (both make the true fraction smaller)."""
    if accum < 1:
        raise ValueError(f"eval_step_fraction(accum={accum}): accum >= 1 is required")
    per_micro_batch = FORWARDS_PER_TRAINING_MICRO_BATCH + (1 if recompute else 0)
    return micro_batches_per_replica(dp) / (accum * per_micro_batch)
