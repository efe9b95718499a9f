"""Fixtures of the validator tests; plain helpers live in validate_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from validate_helpers import write_recipe
from validator_fixtures import base


@pytest.fixture
def base_file(tmp_path: Path) -> Path:
    """The base fixture recipe written to a temp file."""
    return write_recipe(tmp_path, base())


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a fresh working directory (the CLI records the workspace's recipe there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
