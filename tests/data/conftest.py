"""Shared helpers of the data tests: tiny indexed datasets written with megatron-core's own builder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from v4launch.data.indexed import megatron_indexed


def write_dataset(prefix: Path, lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    """Write documents of ``lengths`` (random ids 0..256) at ``prefix``; return their token arrays."""
    idx = megatron_indexed()
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 257, size=n).astype(np.uint16) for n in lengths]
    builder = idx.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in docs:
        builder.add_document(d, [d.size])
    builder.finalize(f"{prefix}.idx")
    return docs


@pytest.fixture
def make_dataset():
    """Factory: ``make_dataset(lengths) -> (prefix, docs)`` in a fresh temporary directory (hypothesis-safe)."""
    dirs: list[tempfile.TemporaryDirectory] = []

    def make(lengths: list[int], seed: int = 0) -> tuple[Path, list[np.ndarray]]:
        d = tempfile.TemporaryDirectory()
        dirs.append(d)
        prefix = Path(d.name) / "ds"
        return prefix, write_dataset(prefix, lengths, seed)

    yield make
    for d in dirs:
        d.cleanup()
