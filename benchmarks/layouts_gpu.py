"""The parallel layouts through ``v4launch run`` on the GPUs of one host: parity, speed and memory per layout.

Each layout is one product run (``v4launch run RECIPE --max-steps N overrides``) of the benchmark
model shape (recipes/bench_h200.yaml: dim 1024, 8 layers + MTP, 24 experts top-4, vocab 129,280),
all on the same data in one workspace, so every run's step 1 starts from the same weights on the
same global batch. Reported per layout, from the run's own metrics.jsonl:

* parity (issue 22's criterion): ``|x - truth| / |truth|`` of step 1's LM loss and gradient norm
  and of step 2's LM loss (after one optimizer step), where truth is the one-GPU float32 run; a
  bf16 layout passes when its error is at most 1.5x the one-GPU bf16 run's (a floor of 1e-4 absorbs
  errors that are both at float32 rounding);
* step time and tokens/s per GPU (median of steps 3..N), peak GPU memory per rank (the job's
  ``memory`` event).

Usage (on a machine with >= the layouts' GPUs)::

    python benchmarks/layouts_gpu.py --gpus 2 --steps 8 --out results.json

Prints a table and writes JSON. Layouts needing more GPUs than ``--gpus`` are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "bench_h200.yaml"
SEQ = 8192
# name -> (GPUs, dtype, overrides). Every layout trains 2 packed sequences of 8,192 tokens per step.
LAYOUTS: dict[str, tuple[int, str, list[str]]] = {
    "1gpu-fp32": (1, "fp32", ["parallel.global_batch_size=2"]),
    "1gpu-bf16": (1, "bf16", ["parallel.global_batch_size=2"]),
    "dp2": (2, "bf16", ["parallel.global_batch_size=2"]),
    "pp2": (2, "bf16", ["parallel.global_batch_size=2", "parallel.pp=2", "parallel.pp_layout=Et*6|t*2mL"]),
    "ep2": (2, "bf16", ["parallel.global_batch_size=2", "parallel.ep=2"]),
    "fsdp2": (2, "bf16", ["parallel.global_batch_size=2", "parallel.distributed_optimizer=true"]),
    "cp2": (2, "bf16", ["parallel.global_batch_size=2", "parallel.cp=2"]),
    "ep2-fsdp2": (2, "bf16", ["parallel.global_batch_size=2", "parallel.ep=2", "parallel.distributed_optimizer=true"]),
    "pp2-ep2": (4, "bf16", ["parallel.global_batch_size=4", "parallel.pp=2", "parallel.pp_layout=Et*6|t*2mL",
                            "parallel.ep=2"]),
    "pp2-cp2": (4, "bf16", ["parallel.global_batch_size=2", "parallel.pp=2", "parallel.pp_layout=Et*6|t*2mL",
                            "parallel.cp=2"]),
    "ep2-cp2": (4, "bf16", ["parallel.global_batch_size=2", "parallel.ep=2", "parallel.cp=2"]),
    "cp4": (4, "bf16", ["parallel.global_batch_size=1", "parallel.cp=4"]),
}


def run_layout(name: str, gpus: int, dtype: str, overrides: list[str], steps: int, workspace: Path) -> dict:
    """One ``v4launch run``; returns its records (train steps, memory event) and wall time."""
    args = [sys.executable, "-m", "v4launch", "run", str(RECIPE), "--max-steps", str(steps), "--no-progress",
            f"cluster.gpus_per_node={gpus}", f"precision.dtype={dtype}", *overrides,
            "curriculum.stages.0.steps=1000", "logging.interval_steps=1", "checkpointing.interval_steps=100000"]
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=workspace, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (workspace / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return {"name": name, "ok": False, "wall_s": wall, "error": (proc.stdout + proc.stderr)[-2000:]}
    run_dir = Path(next(line.split("run directory: ", 1)[1].strip() for line in proc.stdout.splitlines()
                        if "run directory: " in line))
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in recs if r["kind"] == "train"}
    memory = [r for r in recs if r["kind"] == "event" and r.get("event") == "memory"]
    times = [train[s]["step_time_s"] for s in sorted(train) if s >= 3]
    return {"name": name, "ok": True, "gpus": gpus, "dtype": dtype, "wall_s": wall,
            "loss1": train[1]["lm_loss"], "gn1": train[1]["grad_norm"], "loss2": train[2]["lm_loss"],
            "step_s": statistics.median(times) if times else None,
            "tok_s_gpu": (2 * SEQ / statistics.median(times) / gpus) if times else None,
            "peak_gib": memory[-1]["peak_gib"] if memory else None}


def _err(x: float, truth: float) -> float:
    return abs(x - truth) / max(abs(truth), 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", nargs="*", default=None, help="layout names (default: all that fit)")
    parser.add_argument("--workspace", type=Path, default=Path("/tmp/layouts_ws"))
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args()
    a.workspace.mkdir(parents=True, exist_ok=True)
    (a.workspace / ".v4launch").mkdir(exist_ok=True)
    names = a.only or [n for n, (g, _, _) in LAYOUTS.items() if g <= a.gpus]
    results = {}
    for name in names:
        gpus, dtype, over = LAYOUTS[name]
        results[name] = run_layout(name, gpus, dtype, over, a.steps, a.workspace)
        print(json.dumps(results[name])[:400], flush=True)
    truth, base = results.get("1gpu-fp32"), results.get("1gpu-bf16")
    print(f"\n{'layout':<12} {'gpus':>4} {'step ms':>8} {'tok/s/GPU':>10} {'peak GiB/rank':>18} "
          f"{'err loss1':>10} {'err gn1':>9} {'err loss2':>10} parity")
    for name, r in results.items():
        if not r["ok"]:
            print(f"{name:<12} FAILED: {r['error'][-300:]!r}")
            continue
        errs = [_err(r[k], truth[k]) for k in ("loss1", "gn1", "loss2")] if truth and truth["ok"] else [float("nan")] * 3
        if base and base["ok"] and truth and truth["ok"] and r["dtype"] == "bf16":
            limits = [max(1.5 * _err(base[k], truth[k]), 1e-4) for k in ("loss1", "gn1", "loss2")]
            r["parity"] = all(e <= lim for e, lim in zip(errs, limits))
        r["errors"] = errs
        peak = " ".join(f"{x:.1f}" for x in r["peak_gib"]) if r["peak_gib"] else "-"
        step = f"{r['step_s'] * 1e3:.0f}" if r["step_s"] else "-"
        tok = f"{r['tok_s_gpu']:.0f}" if r["tok_s_gpu"] else "-"
        print(f"{name:<12} {r['gpus']:>4} {step:>8} {tok:>10} {peak:>18} {errs[0]:>10.2e} {errs[1]:>9.2e} "
              f"{errs[2]:>10.2e} {r.get('parity', '-')}")
    if a.out:
        a.out.write_text(json.dumps({"argv": sys.argv, "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",)},
                                     "results": results}, indent=1))


if __name__ == "__main__":
    main()
