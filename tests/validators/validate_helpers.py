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
