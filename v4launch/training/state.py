"""What the job keeps between steps and puts into every checkpoint.

Checkpoint keys (v4launch.checkpoints.base.STATE_KEYS): ``model`` and ``optimizer`` (FQN-keyed
Statefuls), ``dataloader`` (the current stage loader's state), ``lr_scheduler`` (the global step
the schedule is at), ``curriculum`` (stage index, steps done in it, phase, transitions so far)
and ``train_state`` (tokens, elapsed time, RNG states). Saving every RNG state is what makes a
run stopped at step k and resumed bitwise identical to an uninterrupted run on CPU.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Progress:
    """Where the run is. ``step``: global optimizer steps done. ``step_in_stage``: steps done in
    ``stage_index`` (== the stage's budget at a stage-end checkpoint). ``tokens``: training tokens
    consumed, all ranks. ``transitions``: phase changes so far, e.g. ``["dense->warmup@60"]``."""

    stage_index: int = 0
    step: int = 0
    step_in_stage: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    phase: str = "dense"
    transitions: list[str] = field(default_factory=list)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU, and CUDA when present) RNG states as a plain dict."""
    state = {"torch": torch.get_rng_state(),
             "python": json.dumps(_jsonable(random.getstate())),
             "numpy": json.dumps(_jsonable(np.random.get_state()))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, tuple | list):
        return [_jsonable(o) for o in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _tupled(obj: Any) -> Any:
    return tuple(_tupled(o) for o in obj) if isinstance(obj, list) else obj


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(_tupled(json.loads(state["python"])))
    name, keys, pos, has_gauss, cached = json.loads(state["numpy"])
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def progress_state(p: Progress) -> dict[str, Any]:
    """The ``curriculum`` checkpoint entry (JSON text, so DCP treats it as one opaque value)."""
    return {"progress": json.dumps(asdict(p))}


def progress_from(state: dict[str, Any]) -> Progress:
    """Inverse of :func:`progress_state`."""
    return Progress(**json.loads(state["progress"]))


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def stage_seed(run_seed: int, stage_index: int) -> int:
    """Seed every stage starts from, so a stage started after a resume draws what an uninterrupted run draws."""
    return (run_seed * 1_000_003 + 7919 * (stage_index + 1)) % 2**63


def set_determinism(deterministic: bool, threads: int | None) -> None:
    """Deterministic algorithms (CPU runs are then bitwise reproducible) and the intra-op thread count."""
    if threads:
        torch.set_num_threads(threads)
    if deterministic and torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=False)
