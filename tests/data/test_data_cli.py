"""`v4launch data prepare`: prints what it prepared; JSON mode; workspace default and its absence."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from v4launch.cli import app
from v4launch.errors import UsageError


def test_prepare_json_then_reuse(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = ["data", "prepare", "tiny_cpu", "data.max_documents=6", "data.validation_fraction=0.2", "--out", "d/p"]
    first = runner.invoke(app, args + ["--json"])
    assert first.exit_code == 0, first.output
    info = json.loads(first.stdout)
    assert info["num_documents"] + info["num_valid_documents"] == 6 and info["reused"] is False
    assert (tmp_path / "d" / "p.train.bin").is_file() and info["entropy_nats"] > 0
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "reused" in again.stdout and "nats/token" in again.stdout


def test_no_recipe_and_no_workspace_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["data", "prepare", "data.max_documents=3"])
    assert isinstance(result.exception, UsageError) and "no recipe given" in result.exception.message


def test_a_workspace_above_the_ceiling_is_not_found(tmp_path, monkeypatch):
    """A ``.v4launch/`` in a parent folder is the workspace (as git finds a repository), unless the walk is
    stopped below it by V4LAUNCH_CEILING_DIRECTORIES."""
    from v4launch.workspace import CEILING_ENV, Workspace

    (tmp_path / ".v4launch").mkdir()
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    monkeypatch.setenv(CEILING_ENV, "")
    assert Workspace.current(inner).root == tmp_path.resolve()
    monkeypatch.setenv(CEILING_ENV, str(tmp_path / "a"))
    assert Workspace.current(inner).root == inner.resolve()
    monkeypatch.setenv(CEILING_ENV, str(tmp_path))  # the ceiling itself is not searched either
    assert Workspace.current(inner).root == inner.resolve()
