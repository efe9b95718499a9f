"""The held-out evaluation's cost figures (validators/eval_cost.py): counts, token rows, step fraction."""

from __future__ import annotations

import pytest

from v4launch.validators.eval_cost import eval_step_fraction, eval_token_rows, evaluations, micro_batches_per_replica


def test_evaluations_per_stage():
    assert evaluations(47_000, 0) == 1  # stage end only
    assert evaluations(10, 5) == 2  # after step 5, and the end (step 10 is not evaluated twice)
    assert evaluations(11, 5) == 3
    assert evaluations(3, 100) == 1
    with pytest.raises(ValueError, match="steps >= 1"):
        evaluations(0, 5)


def test_token_rows_and_step_fraction_follow_the_replicas():
    assert micro_batches_per_replica(1) == 8 and micro_batches_per_replica(3) == 3 and micro_batches_per_replica(32) == 1
    assert eval_token_rows(dp=2, micro_batch=1, seq_len=512) == 4096  # tiny_cpu's 512-token stages
    assert eval_token_rows(dp=32, micro_batch=1, seq_len=4096) == 32 * 4096  # one micro-batch per replica
    assert eval_step_fraction(dp=2, accum=2) == pytest.approx(4 / 6)
    assert eval_step_fraction(dp=8, accum=16, recompute=True) == pytest.approx(1 / 64)
