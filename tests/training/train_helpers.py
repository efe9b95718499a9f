"""Helpers of the training-job tests: the tiny V4 recipe, a real-text corpus, metrics readers.

The recipe has every layer type (SWA, CSA with indexer, HCA), a hash layer, a shared expert and one
MTP layer, and a dense -> warmup -> sparse curriculum of a few steps; each step takes ~0.1 s on CPU.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any


TINY: dict[str, Any] = {
    "name": "tiny_test",
    "model": {
        "vocab_size": 264, "dim": 32, "n_layers": 3, "compress_ratios": [0, 4, 128, 0],
        "n_heads": 2, "head_dim": 32, "rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32,
        "window_size": 16, "rope": {"yarn": {"factor": 16, "original_seq_len": 4096}},
        "indexer": {"n_heads": 2, "head_dim": 32, "topk": 4},
        "moe": {"n_routed_experts": 4, "n_activated_experts": 2, "n_shared_experts": 1, "moe_inter_dim": 32,
                "n_hash_layers": 1, "balance_loss_alpha": 0.01},
        "mhc": {"hc_mult": 2, "sinkhorn_iters": 3},
        "mtp": {"depth": 1},
    },
    "attention": {"indexer_loss_coeff": 0.1, "kl_chunk_size": 64},
    "parallel": {"micro_batch_size": 1, "global_batch_size": 2},
    "precision": {"dtype": "fp32"},
    "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 1},
    "curriculum": {"stages": [
        {"name": "dense", "seq_len": 64, "phase": "dense", "steps": 3},
        {"name": "warm", "seq_len": 64, "phase": "warmup", "steps": 3},
        {"name": "sparse", "seq_len": 128, "phase": "sparse", "steps": 2},
    ]},
    "optimizer": {"lr": 3.0e-3, "muon_lr": 2.0e-2, "min_lr": 3.0e-4, "warmup_steps": 2},
    "data": {"source": "files", "paths": [], "validation_fraction": 0.2},
    "checkpointing": {"interval_steps": 100, "keep_last": 10},
    "logging": {"tensorboard": False, "plot": False},  # each costs a second or so per run
    "run": {"seed": 0, "threads": 1},
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def corpus(folder: Path, n_files: int = 12) -> list[str]:
    """Real text: a few small standard-library sources copied into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    picked = sorted(p for p in lib.glob("*.py") if 2_000 < p.stat().st_size < 12_000)[:n_files]
    for p in picked:
        (folder / p.name).write_text(p.read_text(encoding="utf-8", errors="replace"))
    return [str(folder)]


def train_records(run_dir: Path) -> dict[int, dict]:
    """step -> train record of metrics.jsonl (each step must appear once)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "train":
            assert rec["step"] not in out, f"step {rec['step']} logged twice"
            out[rec["step"]] = rec
    return out


def losses(records: dict[int, dict]) -> dict[int, tuple]:
    """The bitwise-comparable numbers of each step: lm loss, every aux loss, grad norm."""
    return {s: (r["lm_loss"], tuple(sorted(r["aux"].items())), r["grad_norm"]) for s, r in records.items()}


def assert_resume_is_bitwise(new_run, over: dict, stop_at: int) -> Path:
    """Launch the recipe ``over`` twice with the local launcher (its processes, its layout): once uninterrupted,
    once stopped after ``stop_at`` steps and resumed; every step's losses and gradient norm must be bitwise equal.
    Returns the stopped-and-resumed run directory."""
    from v4launch.launchers import LocalLauncher

    full = new_run(over, name="full")
    assert LocalLauncher().launch(full, progress=False).result.status == "completed"
    run = new_run(over)
    assert LocalLauncher().launch(run, max_steps=stop_at, progress=False).result.step == stop_at
    assert LocalLauncher().launch(run, progress=False).result.status == "completed"
    assert losses(train_records(run)) == losses(train_records(full))
    return run
