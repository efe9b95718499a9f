"""run.gc_interval_steps (training/gc_schedule.py): while the job trains, Python collects garbage only where the
job says (young generations every N steps, full collections between timed steps), and automatic collection is
back on afterwards, also after an error. Checked on real reference cycles through weak references."""

from __future__ import annotations

import gc
import json
import weakref

import pytest

from v4launch.training.gc_schedule import GarbageCollection
from v4launch.training.job import train


class _Node:
    """A reference cycle: freed only by the cyclic collector."""

    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


@pytest.fixture(autouse=True)
def _gc_restored():
    was = gc.isenabled()
    yield
    if was:
        gc.enable()


def test_only_the_schedule_collects_while_training():
    schedule = GarbageCollection(interval_steps=4)
    with schedule.during_training():
        assert not gc.isenabled()
        young = _cycle()
        for _ in range(20_000):  # far past generation 0's threshold: automatic collection would have run
            _Node()
        assert young() is not None, "collected although automatic collection is off"
        schedule.after_step(3)
        assert young() is not None, "step 3 is not a multiple of 4"
        schedule.after_step(8)
        assert young() is None, "the young-generation collection at step 8 frees a new cycle"
        node = _Node()
        old = weakref.ref(node)
        gc.collect(1)  # it survives (still referenced): moved past the young generations
        del node
        schedule.after_step(12)
        assert old() is not None, "a young-generation collection does not reach the oldest generation"
        schedule.full()
        assert old() is None, "the full collection frees it"
    assert gc.isenabled()


def test_automatic_collection_comes_back_after_an_error():
    with pytest.raises(RuntimeError, match="step failed"), GarbageCollection(50).during_training():
        assert not gc.isenabled()
        raise RuntimeError("step failed")
    assert gc.isenabled()


def test_interval_zero_leaves_python_in_charge():
    schedule = GarbageCollection(0)
    with schedule.during_training():
        assert gc.isenabled()
        schedule.after_step(50)
        schedule.full()
    assert "automatic collection (run.gc_interval_steps=0)" in schedule.describe()
    with pytest.raises(ValueError, match="run.gc_interval_steps = -1"):
        GarbageCollection(-1)


def test_the_job_says_its_schedule_and_restores_collection(new_run):
    run = new_run({"run": {"gc_interval_steps": 2}})
    assert gc.isenabled()
    assert train(run, progress=False).status == "completed"
    assert gc.isenabled()
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    gc_events = [e for e in events if e.get("event") == "gc"]
    assert len(gc_events) == 1 and gc_events[0]["interval_steps"] == 2
    assert "young generations every 2 steps" in (run / "logs" / "rank0.log").read_text()
