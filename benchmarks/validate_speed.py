"""Wall time of `v4launch validate` per shipped recipe: cold CLI process and in-process load + validate.

    .venv/bin/python benchmarks/validate_speed.py            # table
    .venv/bin/python benchmarks/validate_speed.py --json     # machine-readable

Cold start runs the real console entry point in a fresh interpreter (imports included), in
a scratch working directory so the workspace state of the checkout is left alone. In-process
is the median of repeated ``validate_recipe(load_recipe(...))`` calls after one warm-up.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
ENTRY = "import sys; from v4launch.cli import main; sys.argv = ['v4launch', *sys.argv[1:]]; main()"


def cold(recipe: Path, runs: int, workdir: str) -> tuple[float, int]:
    """Median wall time (s) of a fresh `v4launch validate RECIPE --json` process, and its exit code."""
    times, code = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", ENTRY, "validate", str(recipe), "--json"],
                              cwd=workdir, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        code = proc.returncode
    return statistics.median(times), code


def in_process(recipe: Path, runs: int) -> tuple[float, float]:
    """Median wall time (s) of load_recipe and of load + validate, after one warm-up call."""
    from v4launch.recipe_loading import load_recipe
    from v4launch.validators import validate_recipe

    validate_recipe(load_recipe(recipe))
    loads, totals = [], []
    for _ in range(runs):
        start = time.perf_counter()
        loaded = load_recipe(recipe)
        mid = time.perf_counter()
        validate_recipe(loaded)
        loads.append(mid - start)
        totals.append(time.perf_counter() - start)
    return statistics.median(loads), statistics.median(totals)


def main() -> None:
    as_json = "--json" in sys.argv
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for recipe in RECIPES:
            cold_s, code = cold(recipe, 3, workdir)
            load_s, total_s = in_process(recipe, 20)
            rows.append({"recipe": recipe.name, "exit": code, "cold_cli_s": round(cold_s, 3),
                         "load_s": round(load_s, 4), "load_validate_s": round(total_s, 4)})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'recipe':<16} {'exit':>4} {'cold CLI (s)':>13} {'load (ms)':>10} {'load+validate (ms)':>19}")
    for r in rows:
        print(f"{r['recipe']:<16} {r['exit']:>4} {r['cold_cli_s']:>13.3f} {r['load_s'] * 1e3:>10.1f} {r['load_validate_s'] * 1e3:>19.1f}")
    print(f"\npython {sys.version.split()[0]}; cold = median of 3 fresh processes, in-process = median of 20 calls")


if __name__ == "__main__":
    main()
