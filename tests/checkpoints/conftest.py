"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import pytest
from ckpt_helpers import tiny_dict

from v4launch.validators.schema import Recipe


@pytest.fixture
def recipe() -> Recipe:
    """The embedded tiny_cpu recipe (stages: dense_1k, warmup_1k, sparse_2k)."""
    return Recipe.model_validate(tiny_dict())
