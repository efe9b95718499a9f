"""Experiment-tracker rules: a tracker the recipe asks for must be importable where the job runs."""

from __future__ import annotations

import importlib.util
import sys

from .base import Context, rule


def package_installed(name: str) -> bool:
    """True when the top-level package ``name`` can be imported here (already in ``sys.modules``, or found on
    the path), without importing it; a ``None`` entry in ``sys.modules`` blocks the import (False)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


@rule("V4-WANDB-INSTALLED", fields=("logging.wandb.mode",), scope="recipe",
      fix="pip install 'v4launch[wandb]' (or pip install wandb) in the Python that runs the job, "
          "or set logging.wandb.mode=disabled")
def check_wandb_installed(ctx: Context):
    """Logging to Weights & Biases (logging.wandb, mode online or offline) needs the wandb package.

    Source: v4launch/training/trackers.py (rank 0 imports wandb at the job's start); pyproject.toml extra ``wandb``.
    Checked in the Python that validates; the job's nodes need the same package.
    """
    wandb = ctx.recipe.logging.wandb
    if wandb is None:
        return ctx.na("no logging.wandb")
    if wandb.mode != "disabled" and not package_installed("wandb"):
        return ctx.finding("logging.wandb.mode", wandb.mode, f"logging.wandb.mode={wandb.mode} (project "
                           f"{wandb.project}): the wandb package is not installed in this Python "
                           f"({sys.executable}), so the job could not log to Weights & Biases")
    return ctx.ok("logging.wandb.mode", wandb.mode, "nothing is logged" if wandb.mode == "disabled"
                  else f"project {wandb.project}")
