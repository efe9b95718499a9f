"""V4LAUNCH_PROFILE_STEPS (training/step_profile.py): a profile of the chosen steps of a run, or a clear refusal.

The profiler's own numbers are torch's; what is checked here is the contract around them: which steps are
recorded, what is written where, and that a malformed value is refused before a run directory exists.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import torch

from v4launch.errors import UsageError
from v4launch.training.step_profile import ENV, StepProfiler, parse_steps


def test_parse_steps():
    assert parse_steps("5:8") == (5, 8) and parse_steps(" 7 ") == (7, 7) and parse_steps("3:3") == (3, 3)
    for bad in ("0:2", "4:2", "x", "2:y", ":3", "-1:2", "1:2:3"):
        with pytest.raises(UsageError, match=re.escape(f"{ENV}={bad!r}")):
            parse_steps(bad)


def test_profiles_exactly_the_steps_asked_for(tmp_path: Path):
    prof = StepProfiler(tmp_path / "profile", rank=3, spec="2:3")
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    written = []
    for step in range(1, 6):
        prof.begin(step)
        for _ in range(step * 10):  # a different number of matmuls per step: the table counts those of 2 and 3
            a = torch.tanh(a @ b)
        written.append(prof.end(step))
    assert written[:2] == [None, None] and written[3:] == [None, None]
    table = written[2]
    assert table == tmp_path / "profile" / "rank3_steps2-3.txt"
    text = table.read_text()
    assert re.match(r"steps 2-3 \(2\), rank 3: wall [\d.]+ ms/step, host \(self CPU, GPU waits excluded\) [\d.]+ ms/step",
                    text)
    calls = int(re.search(r"aten::mm\s.*?\s(\d+)\s*$", text, re.M).group(1))
    assert calls == 20 + 30
    launched = text.split("most calls per step")[1]
    per_step = {m.group(2): float(m.group(1)) for m in re.finditer(r"^\s+([\d.]+)\s+[\d.]+ ms\s+(\S+)$", launched, re.M)}
    assert per_step["aten::mm"] == per_step["aten::tanh"] == (20 + 30) / 2
    with gzip.open(tmp_path / "profile" / "rank3_steps2-3.trace.json.gz", "rt") as f:
        trace = json.load(f)
    assert sum(1 for e in trace["traceEvents"] if e.get("name") == "aten::mm") == 20 + 30


def test_a_window_the_run_stops_inside_is_closed_and_written(tmp_path: Path):
    """A run that stops (max_steps, a signal, the end of the curriculum, an error) inside the window: the
    profiler is closed (left open, it crashes the process at exit) and the steps it saw are written."""
    prof = StepProfiler(tmp_path, rank=0, spec="2:9")
    x = torch.randn(32, 32)
    for step in (1, 2, 3):
        prof.begin(step)
        x = x @ x.T / 32
        assert prof.end(step) is None
    note = prof.close(3)
    assert "steps 2-3 (the run stopped before step 9)" in note and (tmp_path / "rank0_steps2-3.txt").exists()
    assert prof.close(3) is None  # once
    late = StepProfiler(tmp_path, rank=0, spec="100:200")
    assert "stopped at step 3, before step 100: nothing profiled" in late.close(3)
    done = StepProfiler(tmp_path, rank=0, spec="1:1")
    done.begin(1)
    assert done.end(1) is not None and done.close(5) is None


def test_off_without_the_variable(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    prof = StepProfiler(tmp_path, rank=0)
    prof.begin(1)
    assert prof.steps is None and prof.end(1) is None and not list(tmp_path.iterdir())


def test_a_malformed_value_is_refused_before_a_run_exists(tmp_path: Path, monkeypatch):
    from test_train_crash_and_cli import _cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV, "9:1")
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
    code, out = _cli("run", str(recipe), "--max-steps", "1")
    assert code == 2 and f"{ENV}='9:1'" in out and "first <= last" in out
    assert not (tmp_path / "runs").exists()
    code, out = _cli("submit", str(recipe), "--dry-run")
    assert code == 2 and f"{ENV}='9:1'" in out


@pytest.mark.slow
def test_a_run_stopped_inside_the_window_ends_cleanly(tmp_path: Path, monkeypatch):
    """`--max-steps 3` with V4LAUNCH_PROFILE_STEPS=2:9 on the tiny recipe's two processes: exit 0 (an open
    profiler used to kill both ranks with SIGSEGV at exit), both ranks' tables for steps 2-3, and the event."""
    import json

    from test_train_crash_and_cli import _cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV, "2:9")
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
    code, out = _cli("run", str(recipe), "--max-steps", "3", "--no-progress")
    assert code == 0, out
    (run,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in (run / "profile").iterdir()) == [
        "rank0_steps2-3.trace.json.gz", "rank0_steps2-3.txt", "rank1_steps2-3.trace.json.gz", "rank1_steps2-3.txt"]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "profile" and "stopped before step 9" in (run / "logs" / "rank0.log").read_text()
               for e in events)


def test_host_waits_counts_sync_warnings_by_where_they_came_from(monkeypatch):
    """``host_waits`` keys each sync-debug warning by the caller's ``where(stack)`` and ignores other warnings;
    the debug mode is switched back to default even when the step raises (CUDA itself stubbed out here)."""
    import warnings

    import torch

    from v4launch.training.step_profile import host_waits

    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def read_twice():
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("called a synchronizing CUDA operation")

    def step():
        read_twice()
        warnings.warn("some other warning")
        warnings.warn("called a synchronizing CUDA operation")

    seen = host_waits(step, lambda stack: stack[-1].name)
    assert dict(seen) == {"read_twice": 2, "step": 1} and modes == ["warn", "default"]

    def failing():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        host_waits(failing, lambda stack: "x")
    assert modes[-1] == "default"


def test_host_time_leaves_out_the_waits_for_the_gpu():
    """A step that ends in a synchronisation: the host's self time inside cudaDeviceSynchronize (and the stream
    and event forms) is waiting, not host work; kernels count once, annotations spanning them not at all."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from v4launch.training.step_profile import HOST_WAIT_CALLS, host_and_device_ms

    cpu = lambda key, us: SimpleNamespace(key=key, device_type=DeviceType.CPU, self_cpu_time_total=us)  # noqa: E731
    gpu = lambda key, us, note=False: SimpleNamespace(key=key, device_type=DeviceType.CUDA,  # noqa: E731
                                                      self_device_time_total=us, is_user_annotation=note)
    waits = [cpu(name, 40_000.0) for name in sorted(HOST_WAIT_CALLS)]
    events = [cpu("cudaGraphLaunch", 500.0), cpu("aten::mm", 1_500.0), *waits,
              gpu("nvjet_gemm", 100_000.0), gpu("_sparse_bwd", 30_000.0), gpu("Optimizer.step#AdamW.step", 9_000.0, True),
              gpu("Command Buffer Full", 16_000.0)]  # a launch waiting for queue room: no kernel's time
    assert host_and_device_ms(events) == (2.0, 130.0)
    assert {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"} <= HOST_WAIT_CALLS
