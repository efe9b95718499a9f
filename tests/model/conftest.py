"""Shared fixtures for the model tests (helpers live in v4_helpers.py)."""

from __future__ import annotations

import pytest
import torch

from v4_helpers import fresh_gen


@pytest.fixture
def gen() -> torch.Generator:
    return fresh_gen()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls are dominated by thread barriers on a busy 2-core machine: run them on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
