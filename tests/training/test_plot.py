"""`v4launch plot`: the series the picture draws are the run's (checked on the Figure's lines), the stage and
phase boundaries sit where the stages change, the job writes plot.png at each stage end, a plotting failure is
a warning, and a missing matplotlib is a clear error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from v4launch.errors import UsageError  # noqa: E402
from v4launch.plot import PLOT_PNG, read_metrics, run_figure, stage_end_plot, write_plot  # noqa: E402

STAGES = [("dense", "dense", 4), ("warm", "warmup", 3), ("sparse", "sparse", 3)]


def synthetic_run(folder: Path) -> Path:
    """A run directory whose metrics.jsonl has 10 steps over 3 stages, interval and stage-end evaluations,
    events, a replayed step 5 (a resume after a crash: the newer record wins) and a half-written last line."""
    folder.mkdir()
    lines, step = [], 0
    for index, (name, phase, steps) in enumerate(STAGES):
        for k in range(1, steps + 1):
            step += 1
            aux = {"balance": 0.01 * step, "mtp": 3.0 - 0.1 * step}
            if phase != "dense":
                aux["indexer_kl"] = 1.0 / step
            lines.append({"kind": "train", "stage": name, "stage_index": index, "phase": phase, "step": step,
                          "lm_loss": 5.0 - 0.2 * step, "aux_sum": aux, "tokens_per_s": 1000.0 + step,
                          "host_rss_gib": 1.0 + 0.01 * step})
            if k == 2 and k < steps:
                lines.append({"kind": "eval", "at": "interval", "stage": name, "stage_index": index, "phase": phase,
                              "step": step, "lm_loss": 4.9 - 0.2 * step})
        lines.append({"kind": "eval", "at": "stage_end", "stage": name, "stage_index": index, "phase": phase,
                      "step": step, "lm_loss": 4.8 - 0.2 * step})
        lines.append({"kind": "event", "step": step, "event": "checkpoint"})
    replayed = dict(lines[6], lm_loss=9.9)  # an earlier attempt's step 5, logged before the newer one
    text = "\n".join(json.dumps(x) for x in [replayed, *lines]) + '\n{"kind": "train", "st'
    (folder / "metrics.jsonl").write_text(text)
    return folder


def lines_by_label(fig) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes for line in ax.get_lines()}


def test_the_figure_draws_the_runs_series_and_marks_its_stages(tmp_path: Path):
    run = synthetic_run(tmp_path / "run")
    fig = run_figure(run)
    drawn = lines_by_label(fig)
    assert drawn["train lm · dense"] == ([1, 2, 3, 4], pytest.approx([4.8, 4.6, 4.4, 4.2]))
    assert drawn["train lm · warm"][0] == [5, 6, 7]
    assert drawn["train lm · warm"][1][0] == pytest.approx(4.0)  # the replayed step's older 9.9 is gone
    assert drawn["held-out · dense"] == ([2, 4], pytest.approx([4.5, 4.0]))
    assert drawn["held-out · sparse"][0] == [9, 10]
    assert drawn["indexer_kl"][0] == [5, 6, 7, 8, 9, 10]  # absent in the dense stage
    assert drawn["balance"][1] == pytest.approx([0.01 * s for s in range(1, 11)])
    assert drawn["mtp"][0] == list(range(1, 11))
    assert drawn["tokens/s"][1] == pytest.approx([1000.0 + s for s in range(1, 11)])
    assert drawn["host resident memory (GiB, rank 0)"][1][-1] == pytest.approx(1.1)
    marks = {label: xs[0] for label, (xs, _) in drawn.items() if label.startswith("_stage")}
    assert marks == {"_stage warm (warmup)": 4.5, "_stage sparse (sparse)": 7.5}
    assert sum(1 for ax in fig.axes for ln in ax.get_lines() if ln.get_label().startswith("_stage")) == 2 * 4
    out = write_plot(run, tmp_path / "x.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob(".x.png*"))


def test_missing_matplotlib_and_empty_runs_are_clear_errors(tmp_path: Path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="metrics.jsonl does not exist"):
        run_figure(empty)
    (empty / "metrics.jsonl").write_text('{"kind": "event", "step": 0, "event": "start"}\n')
    with pytest.raises(UsageError, match="holds no training step yet"):
        run_figure(empty)
    run = synthetic_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(UsageError, match="matplotlib, which is not installed") as exc:
        write_plot(run)
    assert "pip install 'v4launch[plot]'" in exc.value.hint
    warnings: list[str] = []
    assert stage_end_plot(run, warnings.append) is None  # the job's stage end: a warning, no exception
    assert len(warnings) == 1 and "not written" in warnings[0] and "logging.plot=false" in warnings[0]
    assert not (run / PLOT_PNG).exists()


def test_a_real_run_gets_plot_png_at_each_stage_end_and_from_the_cli(new_run, workspace):
    from typer.testing import CliRunner

    from v4launch.cli import app
    from v4launch.training.job import train

    run = new_run({"logging": {"plot": True, "eval_interval_steps": 2}})
    assert train(run, max_steps=4, progress=False).step == 4  # through the dense stage's end (step 3)
    assert (run / PLOT_PNG).is_file()
    assert train(run, progress=False).status == "completed"
    data = read_metrics(run)
    drawn = lines_by_label(run_figure(run))
    assert drawn["train lm · sparse"] == ([7, 8], [r["lm_loss"] for r in data.train if r["stage"] == "sparse"])
    assert drawn["held-out · dense"][0] == [2, 3]
    assert all(r["host_rss_gib"] > 0 for r in data.train)
    result = CliRunner().invoke(app, ["plot", str(run), "--out", str(workspace / "p.png")])
    assert result.exit_code == 0, result.output
    assert (workspace / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_validate_through_the_cli_never_imports_matplotlib():
    import subprocess

    code = ("import sys; from v4launch.cli import app\n"
            "from typer.testing import CliRunner\n"
            "r = CliRunner().invoke(app, ['validate', 'tiny_cpu', '--json'])\n"
            "print('EXIT', r.exit_code, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert "EXIT 0 False" in out.stdout, out.stdout + out.stderr
