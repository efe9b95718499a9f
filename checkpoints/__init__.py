"""Checkpoints: torch.distributed.checkpoint saves under fixed keys, a JSON manifest, resume checks.

Imports ``v4launch.validators``; torch only when a name from dcp.py or stateful.py is first used,
so listing checkpoints (``v4launch status``) stays fast. Layout and verdict table: docs/checkpoints.md.

    base.py      the contract: STATE_KEYS, Manifest, CheckpointStorage, param-group summaries
    listing.py   is_complete / list_checkpoints / latest_checkpoint / list_set_aside (filesystem only)
    dcp.py       save_checkpoint / load_checkpoint / prune (atomic, reshardable)
    stateful.py  ModelState / OptimizerState: FQN-keyed Stateful wrappers for DCP
    compat.py    check_resume -> CompatReport (safe / reshard / refused + override flag)
"""

from .base import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PARALLEL_KEYS,
    STATE_KEYS,
    CheckpointError,
    CheckpointStorage,
    Manifest,
    csa_layer_ids,
    describe_params,
    global_layer_ids,
    recipe_hash,
    summarize_param_groups,
)
from .compat import ALLOW_FLAGS, CompatItem, CompatReport, check_resume
from .listing import SET_ASIDE_PREFIX, is_complete, latest_checkpoint, list_checkpoints, list_set_aside, step_dir_name

_LAZY = {"DCPStorage": "dcp", "load_checkpoint": "dcp", "prune": "dcp", "save_checkpoint": "dcp",
         "ModelState": "stateful", "OptimizerState": "stateful"}  # these import torch

__all__ = [n for n, v in dict(globals()).items() if not n.startswith("_") and not isinstance(v, type(__import__("sys")))]
__all__ += list(_LAZY)


def __getattr__(name: str):
    """Load the torch-backed names on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
