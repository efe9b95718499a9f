"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import pytest
from ckpt_helpers import tiny_dict

from v4launch.validators.schema import Recipe


@pytest.fixture
def recipe() -> Recipe:
    """The embedded tiny_cpu recipe (three stages: dense, warmup, sparse)."""
    return Recipe.model_validate(tiny_dict())
