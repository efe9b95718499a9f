"""Does one run's loss curve track another's? Two runs' metrics.jsonl side by side, step by step.

For issue 17's bf16 check: the benchmark model trained in bf16 with every optimisation on (Triton kernels,
regional compile) against the float32 reference path on the same data (`run_h200_loss_curve.sh` makes the
two runs). Per-step language-model losses are noisy (one batch each), so the curves are compared by their
means over windows of ``--window`` steps; a run tracks the other when every window's mean is within
``--limit`` (relative) of the other's, and the stage-end held-out losses are printed beside them.

Usage: ``python benchmarks/compare_runs.py RUN_A RUN_B [--window 20] [--limit 0.02]`` where RUN_* is a run
directory (``runs/<name>``) or its ``metrics.jsonl``. Prints a table; exit 0 when B tracks A, 1 when not,
2 for unusable input (a missing file, no common steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(path: Path) -> tuple[dict[int, dict], list[dict]]:
    """(train records by step, eval records) of a run directory or a metrics.jsonl file.

    Raises:
        FileNotFoundError: no metrics.jsonl there.
    """
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (give a run directory, runs/<name>, or the file)")
    train, evals = {}, []
    for line in file.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") == "train":
            train[int(rec["step"])] = rec  # a resumed run repeats steps: the last record wins
        elif rec.get("kind") == "eval":
            evals.append(rec)
    return train, evals


def windows(a: dict[int, dict], b: dict[int, dict], width: int) -> list[dict]:
    """Mean lm loss of both runs over consecutive windows of the steps both logged."""
    steps = sorted(set(a) & set(b))
    rows = []
    for i in range(0, len(steps), width):
        part = steps[i:i + width]
        ma = sum(a[s]["lm_loss"] for s in part) / len(part)
        mb = sum(b[s]["lm_loss"] for s in part) / len(part)
        rows.append(dict(first=part[0], last=part[-1], stage=b[part[-1]].get("stage", "?"), a=ma, b=mb,
                         rel=(mb - ma) / abs(ma) if ma else float("inf")))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_a", type=Path, help="the reference run (e.g. float32, reference kernels)")
    ap.add_argument("run_b", type=Path, help="the run that must track it (e.g. bf16, kernels, compiled)")
    ap.add_argument("--window", type=int, default=20, help="steps per window (default 20)")
    ap.add_argument("--limit", type=float, default=0.02, help="largest relative gap of window means (default 0.02)")
    a = ap.parse_args(argv)
    if a.window < 1 or a.limit <= 0:
        print(f"--window {a.window} / --limit {a.limit}: need a window >= 1 and a positive limit", file=sys.stderr)
        return 2
    try:
        (ta, ea), (tb, eb) = read_metrics(a.run_a), read_metrics(a.run_b)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = windows(ta, tb, a.window)
    if not rows:
        print(f"error: the runs share no logged step ({len(ta)} and {len(tb)} train records)", file=sys.stderr)
        return 2
    print(f"A = {a.run_a}\nB = {a.run_b}\nmean lm loss over windows of {a.window} steps (nats/token)\n")
    print(f"{'steps':>11s}  {'stage':14s} {'A':>8s} {'B':>8s} {'B/A - 1':>9s}")
    for r in rows:
        flag = "" if abs(r["rel"]) <= a.limit else "  over"
        print(f"{r['first']:>5d}-{r['last']:<5d}  {r['stage'][:14]:14s} {r['a']:8.4f} {r['b']:8.4f} {r['rel']:+9.2%}{flag}")
    if ea or eb:
        print("\nheld-out lm loss at stage ends")
        by_step = {e["step"]: e for e in eb}
        for e in ea:
            other = by_step.get(e["step"])
            b_text = f"{other['lm_loss']:8.4f} {other['lm_loss'] / e['lm_loss'] - 1:+9.2%}" if other else "       -"
            print(f"  step {e['step']:>5d}  {e.get('stage', '?')[:14]:14s} {e['lm_loss']:8.4f} {b_text}")
    worst = max(rows, key=lambda r: abs(r["rel"]))
    ok = abs(worst["rel"]) <= a.limit
    print(f"\n{'tracks' if ok else 'does NOT track'}: worst window steps {worst['first']}-{worst['last']} "
          f"{worst['rel']:+.2%} (limit ±{a.limit:.0%}) over {len(rows)} windows, {sum(1 for _ in ta.keys() & tb.keys())} steps")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
