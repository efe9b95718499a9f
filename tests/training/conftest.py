"""Fixtures of the training-job tests: a workspace with a small real-text corpus and a tiny V4 recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import yaml
from train_helpers import TINY, _merge, corpus

@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh workspace (cwd) with a ``.v4launch`` folder and a ``text/`` corpus."""
    (tmp_path / ".v4launch").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    corpus(tmp_path / "text")
    return tmp_path


@pytest.fixture
def write_recipe(workspace: Path) -> Callable[..., Path]:
    """``write_recipe(name="r", **section_overrides) -> path`` of a tiny recipe in the workspace."""

    def make(name: str = "recipe", over: dict | None = None) -> Path:
        body = _merge(TINY, {"data": {"paths": [str(workspace / "text")]}})
        body = _merge(body, over or {})
        path = workspace / f"{name}.yaml"
        path.write_text(yaml.safe_dump(body, sort_keys=False))
        return path

    return make


@pytest.fixture
def new_run(workspace: Path, write_recipe) -> Callable[..., Path]:
    """``new_run(over=None, overrides=()) -> run_dir`` (launcher local, recipe frozen)."""
    from v4launch.rundir import create_run_dir
    from v4launch.training.recipe_io import load_recipe
    from v4launch.workspace import Workspace

    def make(over: dict | None = None, overrides: tuple[str, ...] = (), name: str = "recipe") -> Path:
        loaded = load_recipe(write_recipe(name, over), list(overrides))
        return create_run_dir(loaded, "local", {}, workspace=Workspace(workspace))

    return make
