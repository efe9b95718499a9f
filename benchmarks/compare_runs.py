"""Does one run's loss curve track another's? Two runs' metrics.jsonl side by side, step by step.

For issue 17's bf16 check: the benchmark model trained in bf16 with every optimisation on (Triton kernels,
regional compile) against the float32 reference path on the same data (`run_h200_loss_curve.sh` makes the
two runs). Per-step language-model losses are noisy (one batch each), so the curves are compared by their
means over windows of ``--window`` steps; a run tracks the other when every window's mean is within
``--limit`` (relative) of the other's, and the stage-end held-out losses are printed beside them.

Usage: ``python benchmarks/compare_runs.py RUN_A RUN_B [--window 20] [--limit 0.02] [--min-steps 20]`` where
RUN_* is a run directory (``runs/<name>``) or its ``metrics.jsonl``. Windows are step-number ranges cut at
stage changes. Prints a table; exit 0 when B tracks A, 1 when not, 2 for unusable input (a missing or
malformed file, fewer common logged steps than ``--min-steps``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(path: Path) -> tuple[dict[int, dict], list[dict]]:
    """(train records by step, eval records) of a run directory or a metrics.jsonl file. A last line cut short
    (a run killed while writing) is skipped.

    Raises:
        FileNotFoundError: no metrics.jsonl there.
        ValueError: a line that is not JSON (``file:line`` in the message).
    """
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (give a run directory, runs/<name>, or the file)")
    train, evals = {}, []
    lines = file.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue
            raise ValueError(f"{file}:{number}: not a JSON line (is it a run's metrics.jsonl?)") from None
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind in ("train", "eval") and not (isinstance(rec.get("step"), int)
                                              and isinstance(rec.get("lm_loss"), (int, float))):
            raise ValueError(f"{file}:{number}: a {kind} record without an integer step and a number lm_loss")
        if not isinstance(rec, dict):
            raise ValueError(f"{file}:{number}: not a metrics record")
        if kind == "train":
            train[rec["step"]] = rec  # a resumed run repeats steps: the last record wins
        elif kind == "eval":
            evals.append(rec)
    return train, evals


def windows(a: dict[int, dict], b: dict[int, dict], width: int) -> list[dict]:
    """Mean lm loss of both runs over the steps both logged, by windows of ``width`` step numbers
    (steps 1..width, width+1..2·width, …), cut where B's stage changes (a window never mixes stages)."""
    groups: dict[tuple[int, str], list[int]] = {}
    for s in sorted(set(a) & set(b)):
        groups.setdefault(((s - 1) // width, str(b[s].get("stage", "?"))), []).append(s)
    rows = []
    for (_, stage), part in sorted(groups.items(), key=lambda kv: kv[1][0]):
        ma = sum(a[s]["lm_loss"] for s in part) / len(part)
        mb = sum(b[s]["lm_loss"] for s in part) / len(part)
        rows.append(dict(first=part[0], last=part[-1], stage=stage, a=ma, b=mb, n=len(part),
                         rel=(mb - ma) / abs(ma) if ma else float("inf")))
    return rows


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_a", type=Path, help="the reference run (e.g. float32, reference kernels)")
    ap.add_argument("run_b", type=Path, help="the run that must track it (e.g. bf16, kernels, compiled)")
    ap.add_argument("--window", type=int, default=20, help="steps per window (default 20)")
    ap.add_argument("--limit", type=float, default=0.02, help="largest relative gap of window means (default 0.02)")
    ap.add_argument("--min-steps", type=int, default=20,
                    help="fewest steps both runs must have logged for a verdict (default 20)")
    a = ap.parse_args(argv)
    if a.window < 1 or not 0 < a.limit < float("inf") or a.min_steps < 1:
        print(f"--window {a.window} / --limit {a.limit} / --min-steps {a.min_steps}: need a window >= 1, a finite "
              "positive limit and at least one step", file=sys.stderr)
        return 2
    try:
        (ta, ea), (tb, eb) = read_metrics(a.run_a), read_metrics(a.run_b)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    common = len(ta.keys() & tb.keys())
    if common < a.min_steps:
        print(f"error: the runs share {_plural(common, 'logged step')} ({len(ta)} and {len(tb)} train records), fewer "
              f"than --min-steps {a.min_steps}: no verdict (same curriculum and logging.interval_steps?)",
              file=sys.stderr)
        return 2
    rows = windows(ta, tb, a.window)
    print(f"A = {a.run_a}\nB = {a.run_b}\nmean lm loss over windows of {a.window} step numbers, cut at stage changes "
          f"(nats/token)\n")
    print(f"{'steps':>11s}  {'stage':14s} {'logged':>6s} {'A':>8s} {'B':>8s} {'B/A - 1':>9s}")
    for r in rows:
        flag = "" if abs(r["rel"]) <= a.limit else "  over"
        print(f"{r['first']:>5d}-{r['last']:<5d}  {r['stage'][:14]:14s} {r['n']:>6d} {r['a']:8.4f} {r['b']:8.4f} "
              f"{r['rel']:+9.2%}{flag}")
    if ea or eb:
        print("\nheld-out lm loss at stage ends")
        a_by, b_by = {e["step"]: e for e in ea}, {e["step"]: e for e in eb}
        for step in sorted(a_by.keys() | b_by.keys()):
            ra, rb = a_by.get(step), b_by.get(step)
            stage = (ra or rb).get("stage", "?")
            a_text = f"{ra['lm_loss']:8.4f}" if ra else "       -"
            b_text = f"{rb['lm_loss']:8.4f}" if rb else "       -"
            gap = f" {rb['lm_loss'] / ra['lm_loss'] - 1:+9.2%}" if ra and rb else ""
            print(f"  step {step:>5d}  {stage[:14]:14s} {a_text} {b_text}{gap}")
    worst = max(rows, key=lambda r: abs(r["rel"]))
    ok = abs(worst["rel"]) <= a.limit
    print(f"\n{'tracks' if ok else 'does NOT track'}: worst window steps {worst['first']}-{worst['last']} "
          f"{worst['rel']:+.2%} (limit ±{100 * a.limit:g}%) over {_plural(len(rows), 'window')}, "
          f"{_plural(common, 'step')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
