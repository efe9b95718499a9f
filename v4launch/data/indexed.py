"""megatron-core's indexed-dataset module (.bin/.idx), imported on first use.

The one place the data code reaches megatron-core: ``prepare`` writes datasets with its
``IndexedDatasetBuilder``; ``packing`` and ``blend`` read them with its ``IndexedDataset``.
"""

from __future__ import annotations

import warnings


def megatron_indexed():
    """``megatron.core.datasets.indexed_dataset``, imported with its TE/Apex warnings silenced.

    The import takes seconds (megatron-core probes optional GPU libraries), so callers make it
    when they first read or write a dataset, never at package import.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset
