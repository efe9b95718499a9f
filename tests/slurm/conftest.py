"""Fixtures of the Slurm tests: the dev cluster (skip when it is not up) and a fresh workspace."""

from __future__ import annotations

from pathlib import Path

import pytest
from slurm_helpers import cluster_problem


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """Skip unless the dev cluster accepts jobs."""
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """A fresh workspace whose path holds a space and shell metacharacters (quoting on a real sbatch)."""
    ws = tmp_path / "ws $(x) 'q'"
    (ws / ".v4launch").mkdir(parents=True)
    monkeypatch.chdir(ws)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return ws




@pytest.fixture
def ws(tmp_path) -> Path:
    """An empty workspace (``.v4launch/``) at a plain path; the test passes it as ``cwd``."""
    (tmp_path / ".v4launch").mkdir()
    return tmp_path
