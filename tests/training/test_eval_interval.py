"""logging.eval_interval_steps: held-out losses during each stage, on the same schedule after a resume,
leaving the training steps bitwise as they are without it; the count the cost model states is the job's."""

from __future__ import annotations

import json
from pathlib import Path

from train_helpers import TINY, losses, train_records

from v4launch.training.job import train
from v4launch.validators.eval_cost import evaluations

EVERY = {"logging": {"eval_interval_steps": 2}}
# TINY's stages: dense 3 steps, warm 3, sparse 2 -> interval evaluations after steps 2 (dense) and 5 (warm);
# stage ends 3, 6, 8 (the sparse stage's step 2 is its end: evaluated once)
EXPECTED = [(2, "interval", "dense"), (3, "stage_end", "dense"), (5, "interval", "warm"), (6, "stage_end", "warm"),
            (8, "stage_end", "sparse")]


def evals(run: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "eval"]


def test_interval_evaluations_during_each_stage_leave_training_as_it_was(new_run):
    plain = new_run(name="plain")
    assert train(plain, progress=False).status == "completed"
    run = new_run(EVERY)
    assert train(run, progress=False).status == "completed"
    got = evals(run)
    assert [(r["step"], r["at"], r["stage"]) for r in got] == EXPECTED
    assert [r["step_in_stage"] for r in got] == [2, 3, 2, 3, 2]
    # the training steps are bitwise those of the run without interval evaluations
    assert losses(train_records(run)) == losses(train_records(plain))
    # stage-end held-out losses too (same documents, same weights); the interval ones are new points
    ends = {r["step"]: r["lm_loss"] for r in evals(plain)}
    assert ends == {r["step"]: r["lm_loss"] for r in got if r["at"] == "stage_end"}
    assert got[0]["lm_loss"] != got[1]["lm_loss"]  # a step apart: the model moved between them
    # the cost model's count is the job's
    stages = TINY["curriculum"]["stages"]
    assert sum(evaluations(s["steps"], 2) for s in stages) == len(got)


def test_a_resumed_run_evaluates_at_the_same_steps_with_the_same_losses(new_run):
    full = new_run(EVERY, name="full")
    assert train(full, progress=False).status == "completed"
    run = new_run(EVERY)
    assert train(run, max_steps=2, progress=False).step == 2  # stops right after the interval evaluation at 2
    assert [r["step"] for r in evals(run)] == [2]
    assert train(run, max_steps=4, progress=False).step == 4  # stops inside warm, before its evaluation at 5
    assert train(run, progress=False).status == "completed"
    got = evals(run)
    assert [(r["step"], r["at"], r["stage"]) for r in got] == EXPECTED  # none repeated, none missed
    assert [r["lm_loss"] for r in got] == [r["lm_loss"] for r in evals(full)]
