"""``model.init_from_released``: a fresh run starts from imported released weights.

The runner builds the model as on any fresh start (seeded init, parallelised, this rank's part)
and then calls :func:`load_released_init` once: torch.distributed.checkpoint reads, on every rank,
the tensors that rank holds (so any DP / CP / PP layout loads the same import). The import is the
directory ``v4launch checkpoint import`` wrote (``checkpoints/released_import.py``); a
released-format directory itself is refused with the command that imports it.

Indexers: a released model's CSA layers carry trained lightning indexers. A run whose first stage
is ``dense`` (no indexer) would drop them and train fresh ones at the warm-up, so it is refused;
an import without indexers (exported from a dense-phase run) starts a ``warmup`` stage with the
seeded fresh indexers the warm-up is for, and is refused for a ``sparse`` first stage.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ..checkpoints.released_config import INDEX_NAME, NOT_COMPARED, ReleasedCheckpointError
from ..checkpoints.released_import import ImportRecord, unwrap_checkpoint_errors
from ..checkpoints.stateful import ModelState
from ..errors import RefusedError


class _ImportedModelState(ModelState):
    """The model's state dict without the indexer tensors an import does not have (loaded non-strictly)."""

    def __init__(self, model: torch.nn.Module, skip_indexers: bool):
        super().__init__(model, strict=not skip_indexers)
        self.skip_indexers = skip_indexers

    def state_dict(self) -> dict[str, Any]:
        """FQN -> tensor of this rank's model, minus ``.attn.indexer.`` tensors when skipped."""
        sd = super().state_dict()
        return {k: v for k, v in sd.items() if not (self.skip_indexers and ".attn.indexer." in k)}


def load_released_init(model: Any, path: str | Path) -> str:
    """Load the imported checkpoint at ``path`` into ``model`` (a fresh V4Model, possibly parallelised).

    Call on every rank (collective under a process group).

    Returns:
        One line for the log: what was loaded from where.

    Raises:
        RefusedError: ``path`` is not an import (e.g. the released directory itself), the import
            was checked against another architecture (every differing field named), the indexer
            rule of the module docstring, or tensors the model needs are not in the import.
    """
    path = Path(path).expanduser()
    where = f"model.init_from_released={path}"
    if (path / INDEX_NAME).is_file():
        raise RefusedError(f"{where} is a released-format directory, not an imported checkpoint",
                           hint=f"import it first: `v4launch checkpoint import {path} --recipe RECIPE --out DIR`, then "
                                "set model.init_from_released: DIR")
    try:
        record = ImportRecord.read(path)
    except ReleasedCheckpointError as exc:
        raise RefusedError(f"{where}: {exc.message}", hint=exc.hint) from None
    args = model.args
    differ = [f"{k}: import {v!r}, this run {getattr(args, k)!r}" for k, v in record.model_args.items()
              if k not in NOT_COMPARED and _plain(getattr(args, k)) != v]
    if differ:
        raise RefusedError(f"{where} was imported for another model: " + "; ".join(differ),
                           hint="import the release again with this recipe (`v4launch checkpoint import … --recipe`)")
    phase = getattr(model, "phase", "dense")
    if record.indexer_layers and phase == "dense":
        raise RefusedError(f"{where} holds trained indexers (layers {record.indexer_layers}) but the first stage's "
                           "phase is dense, which has none: they would be dropped and trained again at the warm-up",
                           hint="start the curriculum with a sparse (or warmup) stage when continuing released weights")
    if not record.indexer_layers and phase == "sparse":
        raise RefusedError(f"{where} has no indexers (imported from a dense-phase model) but the first stage is "
                           "sparse: untrained indexers would select the attended entries",
                           hint="start the curriculum with a warmup stage (the indexers train there)")
    state = _ImportedModelState(model, skip_indexers=not record.indexer_layers)
    try:
        with warnings.catch_warnings(), unwrap_checkpoint_errors():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp

            dcp.load({"model": state}, storage_reader=dcp.FileSystemReader(str(path)),
                     no_dist=not (dist.is_available() and dist.is_initialized()))
    except (ReleasedCheckpointError, RuntimeError) as exc:
        raise RefusedError(f"{where}: the import does not load into this model ({getattr(exc, 'message', exc)})",
                           hint="import the release again with this recipe") from None
    return f"initialised from the import {path} of {record.source} ({record.n_tensors} tensors, phase {record.phase})"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
