"""Validator test helpers (a uniquely named module, so no other test folder's conftest shadows it):
write recipes, load + validate, invoke the CLI like `main()` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from v4launch.errors import V4LaunchError
from v4launch.recipe_loading import load_recipe
from v4launch.validators import Report, validate_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"

FLASH_4N_FP32 = ("precision.params_dtype=fp32", "precision.exp_avg_dtype=fp32", "precision.exp_avg_sq_dtype=fp32",
                 "parallel.cpu_offloading=false")
"""flash_4n.yaml with the job's default storage: fp32 weights, gradients and moments, no layer input offloaded."""
FLASH_4N_SEED_004 = (*FLASH_4N_FP32, "parallel.pp=4", "parallel.pp_layout=Et*10|t*12|t*12|t*9mL", "parallel.ep=8",
                     "parallel.cp=1", "curriculum.stages.3.cp=2", "curriculum.stages.4.cp=4", "curriculum.stages.5.cp=8")
"""flash_4n.yaml in the shape seed 004 ran (item 12), which the recipe had before precision-aware storage: PP4
``Et*10|t*12|t*12|t*9mL``, EP8, fp32 storage, CP 1 at 64K, 2 at 128K, 4 at 256K, 8 at 1M. V4-MEMORY refuses it
in every stage: the tests' over-budget Flash."""


def write_recipe(folder: Path, data: dict[str, Any], name: str = "recipe.yaml") -> Path:
    """Dump ``data`` as YAML into ``folder/name``."""
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def validate_file(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Report:
    """load_recipe + validate_recipe."""
    return validate_recipe(load_recipe(path, list(overrides)))


def invoke(args: list[str]) -> tuple[int, str, str, BaseException | None]:
    """Run the CLI in-process; map V4LaunchError to its exit code as ``v4launch.cli.main`` does.

    Returns (exit code, stdout, stderr, unexpected exception or None).
    """
    from v4launch.cli import app
    from v4launch.cli.common import report_error

    result = CliRunner().invoke(app, args)
    exc = result.exception
    stderr = result.stderr
    stderr = " ".join(stderr.split())  # rich folds long stderr lines at 80 columns
    if isinstance(exc, V4LaunchError):
        return exc.exit_code, result.stdout, stderr + f" error: {exc.message}\nhint: {exc.hint}\n", None
    if exc is not None and not isinstance(exc, SystemExit):
        return result.exit_code, result.stdout, stderr, exc
    _ = report_error  # the real handler; messages are formatted the same way above
    return result.exit_code, result.stdout, stderr, None
