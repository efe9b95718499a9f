"""A run stopped at step k and resumed produces bitwise the same losses as an uninterrupted run."""

from __future__ import annotations

import threading

from train_helpers import losses, train_records

from v4launch.training.job import train


def test_uninterrupted_run_goes_through_all_phases(new_run):
    run = new_run()
    result = train(run, progress=False)
    assert (result.status, result.step, result.stage_index) == ("completed", 8, 2)
    recs = train_records(run)
    assert [recs[s]["phase"] for s in sorted(recs)] == ["dense"] * 3 + ["warmup"] * 3 + ["sparse"] * 2
    assert result.checkpoint is not None and result.checkpoint.name == "step_00000008"


def test_max_steps_resume_is_bitwise_identical_across_phase_transitions(new_run):
    ref = new_run()
    train(ref, progress=False)
    run = new_run()
    # stop mid-dense (k=2), then one step after the dense->warmup change (k=4), then mid-sparse (k=7)
    for k in (2, 4, 7):
        result = train(run, max_steps=k, progress=False)
        assert (result.status, result.step) == ("max_steps", k)
    assert train(run, progress=False).status == "completed"
    assert losses(train_records(run)) == losses(train_records(ref))


def test_stop_at_stage_end_then_resume_is_bitwise_identical(new_run):
    ref = new_run()
    train(ref, progress=False)
    run = new_run()
    result = train(run, stop_after_stage=True, progress=False)
    assert (result.status, result.step, result.stage_index) == ("stage_completed", 3, 0)
    train(run, progress=False)
    assert losses(train_records(run)) == losses(train_records(ref))


def test_stop_event_finishes_the_step_saves_and_resumes_identically(new_run):
    ref = new_run()
    train(ref, progress=False)
    run = new_run()
    train(run, max_steps=3, progress=False)
    stop = threading.Event()
    stop.set()  # already set: the job does exactly one step, saves, returns
    result = train(run, stop_event=stop, progress=False)
    assert (result.status, result.step) == ("stopped", 4)
    assert result.checkpoint is not None and result.checkpoint.name == "step_00000004"
    train(run, progress=False)
    assert losses(train_records(run)) == losses(train_records(ref))


def test_completed_run_relaunched_does_nothing(new_run):
    run = new_run()
    first = train(run, progress=False)
    again = train(run, progress=False)
    assert (again.status, again.step, again.checkpoint) == ("completed", 8, first.checkpoint)
