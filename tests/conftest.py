"""Every test: the workspace walk stops at pytest's temporary root (``V4LAUNCH_CEILING_DIRECTORIES``), so a
``.v4launch/`` someone left in /tmp (or any folder above the tests' temporary folders) is never a test's
workspace. Subprocesses inherit it."""

from __future__ import annotations

import os

import pytest

from v4launch.workspace import CEILING_ENV


@pytest.fixture(autouse=True, scope="session")
def _workspace_ceiling(tmp_path_factory: pytest.TempPathFactory):
    root = str(tmp_path_factory.getbasetemp())
    before = os.environ.get(CEILING_ENV)
    os.environ[CEILING_ENV] = os.pathsep.join(p for p in (before, root) if p)
    yield
    if before is None:
        os.environ.pop(CEILING_ENV, None)
    else:
        os.environ[CEILING_ENV] = before
