"""benchmarks/compare_runs.py: whether one run's loss curve tracks another's (issue 17's bf16 check).

Two metrics.jsonl files are written here with known curves: one that tracks the reference within the
limit, one that drifts away after a number of steps, and one with a resumed (repeated) step; the script's
verdict, its exit code and the window it names are checked against what the curves were built to be.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "compare_runs.py"


def _write(path: Path, losses: list[float], evals: dict[int, float] = {}) -> Path:
    path.mkdir(parents=True)
    lines = [{"kind": "event", "step": 0, "event": "start"}]
    for step, loss in enumerate(losses, start=1):
        lines.append({"kind": "train", "step": step, "stage": "dense_8k" if step <= 50 else "sparse_8k",
                      "lm_loss": loss})
        if step in evals:
            lines.append({"kind": "eval", "step": step, "stage": "dense_8k", "lm_loss": evals[step]})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _compare(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), *extra], capture_output=True, text=True)


def test_a_curve_within_the_limit_tracks_and_a_drifting_one_does_not(tmp_path: Path):
    rng = random.Random()
    n = 100
    truth = [6.0 * 0.99 ** s + 2.0 for s in range(n)]
    ref = _write(tmp_path / "fp32", [x * (1 + rng.uniform(-0.01, 0.01)) for x in truth], {50: 4.1})
    close = _write(tmp_path / "bf16", [x * (1 + rng.uniform(-0.01, 0.01)) for x in truth], {50: 4.12})
    # the drift starts early in window 61-80 or 81-100 (steps 51-100 are one stage): that window is >= 8% off
    drift_from = 20 * rng.choice((3, 4)) + 1 + rng.randrange(5)
    drifting = _write(tmp_path / "bad", [x * (1.10 if s + 1 >= drift_from else 1.0) for s, x in enumerate(truth)])

    ok = _compare(ref, close, "--window", "20", "--limit", "0.02")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "tracks: worst window" in ok.stdout and "over 6 windows, 100 steps" in ok.stdout
    steps = [line.split()[0] for line in ok.stdout.splitlines() if line[:11].strip()[:1].isdigit()]
    assert steps == ["1-20", "21-40", "41-50", "51-60", "61-80", "81-100"]  # cut at the stage change after 50
    assert "4.1000   4.1200    +0.49%" in ok.stdout  # the held-out row of both runs

    bad = _compare(ref, drifting, "--window", "20", "--limit", "0.02")
    assert bad.returncode == 1 and "does NOT track" in bad.stdout, bad.stdout
    window = (drift_from - 1) // 20
    first_over = f"{20 * window + 1:>5d}-{20 * window + 20:<5d}"
    over_rows = [line for line in bad.stdout.splitlines() if line.endswith("over")]
    assert over_rows and over_rows[0].startswith(first_over), (drift_from, bad.stdout)


def test_unusable_input_exits_2_with_the_reason(tmp_path: Path):
    ref = _write(tmp_path / "a", [3.0, 2.9])
    missing = _compare(ref, tmp_path / "nowhere")
    assert missing.returncode == 2 and "no metrics.jsonl" in missing.stderr
    other = tmp_path / "b"
    other.mkdir()
    (other / "metrics.jsonl").write_text(json.dumps({"kind": "event", "step": 0, "event": "start"}) + "\n")
    none = _compare(ref, other)
    assert none.returncode == 2 and "share 0 logged steps" in none.stderr
    assert _compare(ref, ref, "--window", "0").returncode == 2
    assert _compare(ref, ref, "--limit", "nan").returncode == 2
    short = _compare(ref, ref)  # 2 common steps < --min-steps 20: no verdict
    assert short.returncode == 2 and "share 2 logged steps" in short.stderr
    assert _compare(ref, ref, "--min-steps", "2").returncode == 0
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"kind": "train", "step": 1, "lm_loss": 3.0}\nname: a recipe\n{"kind": "train"}\n')
    bad = _compare(ref, broken)
    assert bad.returncode == 2 and "broken.jsonl:2: not a JSON line" in bad.stderr and "Traceback" not in bad.stderr
    keyless = tmp_path / "keyless.jsonl"
    keyless.write_text('{"kind": "train", "step": 1, "lm_loss": 3.0}\n{"kind": "train", "step": 2}\n{"kind": "event"}\n')
    missing_key = _compare(ref, keyless)
    assert missing_key.returncode == 2 and "keyless.jsonl:2: a train record without" in missing_key.stderr
    cut = tmp_path / "cut.jsonl"  # a run killed while writing its last line: that line is skipped
    cut.write_text('{"kind": "train", "step": 1, "lm_loss": 3.0}\n{"kind": "train", "step": 2, "lm_loss": 2.9}\n{"kind": "tr')
    assert _compare(ref, cut, "--min-steps", "2").returncode == 0
