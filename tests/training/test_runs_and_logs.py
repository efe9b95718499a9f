"""Finding things (issue 42): `v4launch runs` lists the workspace's runs; `logs --rank N --tail K --follow` shows one
rank's log, its last lines, and what it writes next. Run directories are written by hand: no training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from v4launch.launchers import LocalLauncher

EXE = str(Path(sys.executable).with_name("v4launch"))
TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLUMNS="200"))


def make_run(ws: Path, name: str, *, launcher="local", created="2026-01-01T10:00:00+00:00", launch=None,
             metrics=(), ranks=None, jobs=()) -> Path:
    run = ws / "runs" / name
    (run / "logs").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "run.json").write_text(json.dumps({"name": name, "launcher": launcher, "created": created}))
    (run / "recipe.yaml").write_text(TINY.read_text())
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if launch is not None:
        (run / "launch.json").write_text(json.dumps(launch))
    for rank, lines in (ranks or {}).items():
        (run / "logs" / f"rank{rank}.log").write_text("".join(f"{line}\n" for line in lines))
    for job in jobs:
        with (run / "ledger.jsonl").open("a") as f:
            f.write(json.dumps({"time": created, "job_id": job, "event": "submit", "stage": None, "step": None,
                                "detail": ""}) + "\n")
    return run


@pytest.fixture
def ws(tmp_path):
    (tmp_path / ".v4launch").mkdir()
    make_run(tmp_path, "tiny_cpu-20260102-090000", created="2026-01-02T09:00:00+00:00",
             launch={"launcher": "local", "state": "completed", "pids": [1], "world_size": 2},
             metrics=[{"kind": "train", "step": 150, "stage": "sparse_2k", "phase": "sparse", "lm_loss": 2.25}],
             ranks={0: [f"rank0 line {i}" for i in range(5)], 1: [f"rank1 line {i}" for i in range(5)]})
    make_run(tmp_path, "tiny_cpu-20260101-100000", launcher="slurm", jobs=("121", "122"))
    (tmp_path / "runs" / "not-a-run").mkdir()
    return tmp_path


def test_runs_lists_every_run_oldest_first_with_its_slurm_jobs(ws):
    out = cli("runs", "--json", cwd=ws)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["name"] for r in rows] == ["tiny_cpu-20260101-100000", "tiny_cpu-20260102-090000"]
    slurm, local = rows
    assert slurm["slurm_job_ids"] == ["121", "122"] and slurm["launcher"] == "slurm"
    assert (local["state"], local["stage"], local["step"], local["loss"]) == ("completed", "sparse_2k", 150, 2.25)
    assert local["slurm_job_ids"] == [] and local["started"] == "2026-01-02T09:00:00+00:00"
    plain = cli("runs", cwd=ws).stdout.splitlines()  # not a terminal: plain aligned columns, no box drawing
    assert plain[0].split() == ["name", "state", "stage", "step", "loss", "started", "slurm", "jobs"]
    assert plain[1].split()[0] == "tiny_cpu-20260101-100000" and plain[1].split()[-1] == "121,122"
    assert plain[2].split() == ["tiny_cpu-20260102-090000", "completed", "sparse_2k", "150", "2.250", "2026-01-02",
                                "09:00:00", "-"]
    assert not any(ch in "".join(plain) for ch in "┃│━")


def test_logs_rank_and_tail(ws):
    run = ws / "runs" / "tiny_cpu-20260102-090000"
    out = cli("logs", run, "--rank", "1", "--tail", "2", cwd=ws)
    assert out.returncode == 0 and out.stdout.splitlines() == ["rank1 line 3", "rank1 line 4"], out.stderr
    every = cli("logs", run, cwd=ws).stdout.splitlines()
    assert every == [f"rank0 line {i}" for i in range(5)] + [f"rank1 line {i}" for i in range(5)]
    bad = cli("logs", run, "--rank", "2", cwd=ws)
    assert bad.returncode == 2 and "--rank 2" in bad.stderr and "world size 2" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.timeout(60)
def test_logs_follow_prints_new_lines_until_the_run_ends(ws):
    run = make_run(ws, "tiny_cpu-20260103-090000", launch={"launcher": "local", "state": "running",
                                                           "pids": [os.getpid()], "world_size": 2},
                   ranks={0: ["old 0", "old 1", "old 2"], 1: ["other rank"]})

    def write_then_end():
        time.sleep(1.5)
        with (run / "logs" / "rank0.log").open("a") as f:
            f.write("new 0\nnew 1\n")
        time.sleep(1.5)
        launch = json.loads((run / "launch.json").read_text())
        (run / "launch.json").write_text(json.dumps({**launch, "state": "completed"}))

    writer = threading.Thread(target=write_then_end)
    writer.start()
    lines = list(LocalLauncher().logs(run, follow=True, rank=0, tail=1))
    writer.join()
    assert lines == ["old 2", "new 0", "new 1"]


@pytest.fixture
def terminal(monkeypatch):
    """The CLI's output console as an 80-column terminal; returns a function giving what it drew, colours off."""
    import io

    from rich.console import Console

    from v4launch.cli.common import OUT

    buf = io.StringIO()
    monkeypatch.setattr(OUT, "console", Console(file=buf, force_terminal=True, width=80, color_system=None))
    return buf.getvalue


def table_rows(lines: list[str]) -> list[list[str]]:
    """The body rows of a rich table as drawn: each cell's pieces (one per drawn line) joined without spaces."""
    rows: list[list[str]] = []
    for line in lines:
        if line.startswith("│"):
            cells = [c.strip() for c in line[1:-1].split("│")]
            if cells[0]:
                rows.append(cells)
            else:
                rows[-1] = [a + b for a, b in zip(rows[-1], cells)]
    return rows


@pytest.fixture
def slurm_says(monkeypatch):
    """squeue / sacct stood in for: job 121 completed its stage, job 122 runs the next."""
    from v4launch.slurm import query

    states = {"121": "COMPLETED", "122": "RUNNING"}
    monkeypatch.setattr(query, "current_states", lambda ids: {j: states[j] for j in ids if j in states})
    monkeypatch.setattr(query, "queue_states", lambda ids: {j: states[j] for j in ids if states.get(j) == "RUNNING"})
    monkeypatch.setattr(query, "pending_reasons", lambda ids: {})
    monkeypatch.setattr(query, "accounting", lambda ids: {})


def test_runs_draws_a_table_on_a_terminal(ws, terminal, slurm_says):
    """On an 80-column terminal the run names stay whole (they are what one copies); stage, start time and job
    ids fold instead."""
    from v4launch.cli.runs import runs

    runs(root=str(ws / "runs"))
    lines = [line.rstrip() for line in terminal().splitlines()]
    assert lines[0] == f"runs in {ws / 'runs'}"
    assert all(len(line) <= 80 for line in lines)  # fits the terminal
    assert "━" in lines[1] and lines[2].startswith("┃")  # a drawn table, not the plain columns of a pipe
    slurm, local = table_rows(lines)
    assert slurm[0] == "tiny_cpu-20260101-100000" and slurm[-1] == "121,122"  # oldest first, with its job chain
    assert local[:5] == ["tiny_cpu-20260102-090000", "completed", "sparse_2k", "150", "2.250"]
    assert local[5].startswith("2026-01-02") and local[5].endswith("09:00:00") and local[6] == "-"


def test_status_of_a_slurm_run_names_its_job_chain(ws, terminal, slurm_says):
    from v4launch.cli.status import status

    status(run=str(ws / "runs" / "tiny_cpu-20260101-100000"))
    shown = terminal()
    assert "Slurm jobs: 121 -> 122" in shown.splitlines(), shown
    assert "┃ job " in shown  # Slurm job ids title the first column (a local run's say pid)
    local = LocalLauncher().status(ws / "runs" / "tiny_cpu-20260102-090000")
    assert local.detail.get("jobs") is None  # a local run has no chain: no such line (see _job_ids)
